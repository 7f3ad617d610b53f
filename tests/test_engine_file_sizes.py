"""No file of ``curvopt`` is longer than 300 lines: a module holds one job
(``docs/architecture.md``)."""

import pathlib

import curvopt

LIMIT = 300


def test_no_file_of_curvopt_is_over_300_lines():
    root = pathlib.Path(curvopt.__file__).parent
    lengths = {
        path.relative_to(root).as_posix(): len(path.read_text().splitlines())
        for path in root.rglob("*.py")
    }
    over = {name: n for name, n in lengths.items() if n > LIMIT}
    assert not over, f"over {LIMIT} lines: {over}"
    assert "engine/backward.py" in lengths  # the walk found the package
