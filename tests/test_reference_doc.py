"""docs/reference.md is what docs/gen_reference.py writes from the source: the options'
fields (autoplan/options.py), the docstrings of `autoparallel` and `plan`, every command's
`--help` and the dataclasses of autoplan/plan.py."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_reference_is_what_the_source_says():
    spec = importlib.util.spec_from_file_location("gen_reference",
                                                  ROOT / "docs" / "gen_reference.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (ROOT / "docs" / "reference.md").read_text() == gen.reference(), (
        "docs/reference.md is stale: run `python docs/gen_reference.py`")
