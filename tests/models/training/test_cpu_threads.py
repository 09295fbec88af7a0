from models.training.cpu_threads import _cores, cpu_threads_per_process


def test_threads_divide_the_cores_unless_omp_num_threads_says(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = _cores()
    assert cores >= 1
    assert cpu_threads_per_process(1) == cores
    assert cpu_threads_per_process(cores * 4) == 1, "never below one thread"
    assert cpu_threads_per_process(0) == cores
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert cpu_threads_per_process(1) == cpu_threads_per_process(8) == 5
    for junk in ("", "0", "two", "-1", "4,2", "\u00b2"):
        monkeypatch.setenv("OMP_NUM_THREADS", junk)
        assert cpu_threads_per_process(1) == cores, junk
