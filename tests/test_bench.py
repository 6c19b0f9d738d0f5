"""The benchmark harness's bookkeeping (the timing itself needs a GPU)."""

import re

from codetta.bench.harness import Results, Row, env_info, source_hash


def test_source_hash_names_the_code():
    h = source_hash()
    assert re.fullmatch(r"[0-9a-f]{12}", h) and h == source_hash()
    assert env_info()["source"] == h


def test_table_fits_long_variant_names(tmp_path):
    res = Results("t")
    res.add(Row("1B fwd", "cublas", 1.0, 1e9, 1.0))
    res.add(Row("1B fwd", "codetta-foldgamma", 1.06, 1e9, 1.0))
    head = res.table().splitlines()[1]
    assert "cublas" in head and " codetta-foldgamma" in head  # columns do not run together
    res.write(str(tmp_path))
    assert (tmp_path / "t.json").exists() and (tmp_path / "t.csv").exists()
