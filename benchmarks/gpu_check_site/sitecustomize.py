"""The device machine's import set, simulated for the GPU check's dry run.

`benchmarks/gpu_check.py --dry-run` puts this folder first on its steps' PYTHONPATH. Python
then imports this module at start-up, and it hides every installed distribution that is neither
on the device machine (`gpu_device_packages.txt`) nor carried to it (`gpu_wheels.txt`): its
top-level modules are not found, as there. So a training, loader or study import that the
wheel list misses fails here, on the CPU, and not on a lent GPU. Kiln itself is never hidden.
Versions are not simulated: the hidden set is by name.
"""

import importlib.metadata as _md
import re as _re
import sys as _sys
from pathlib import Path as _Path

_HERE = _Path(__file__).resolve().parent.parent


def _names(path: _Path) -> set[str]:
    out = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.add(_re.sub(r"[-_.]+", "-", line.split("==")[0]).lower())
    return out


_ALLOWED = _names(_HERE / "gpu_device_packages.txt") | _names(_HERE / "gpu_wheels.txt") | {"kiln"}
_HIDDEN = {
    top
    for top, dists in _md.packages_distributions().items()
    if not any(_re.sub(r"[-_.]+", "-", d).lower() in _ALLOWED for d in dists)
}


class _HidingPathFinder:
    """The standard path finder, except that hidden top-level modules are not found (so
    `importlib.util.find_spec` answers None, as for a package that is not installed)."""

    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _HIDDEN:
            return None
        return self.inner.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


_sys.meta_path[:] = [
    _HidingPathFinder(f) if getattr(f, "__name__", "") == "PathFinder" else f
    for f in _sys.meta_path
]
