"""Kiln human evaluation: blind A/B ratings of two evaluation studies, and their statistics.

- `store`: the ratings database (SQLAlchemy; SQLite in WAL mode by default);
- `studies`: `kiln evaluate` output and the comparison built from two studies;
- `app`: the FastAPI rating app (`kiln rate serve`);
- `stats`: preference rates, the prompt-level bootstrap, Krippendorff's alpha, Bradley-Terry;
- `report`: report.json, votes.csv and preference.png for a comparison.

Like `models/` and `data_quality/`, this layer never imports Prefect; `flows/` calls it.
"""
