"""The per-step profile tells curvature steps from plain ones."""

from experiments.step_profile import _config, main, profile


def test_practical_preset_has_one_curvature_step_in_ten():
    out = profile(_config("mnist_logreg", "kfac:practical:0.01:0.1"), steps=12)
    assert out["curvature"]["n"] == 1 and out["plain"]["n"] == 10  # steps 1..11, step 10 reads
    assert all(v > 0 for r in out.values() for k, v in r.items() if k.endswith("_ms"))


def test_paper_preset_reads_curvature_every_step_and_adam_never():
    assert set(profile(_config("mnist_logreg", "kfac:paper:0.1:0.1"), steps=3)) == {"curvature"}
    assert set(profile(_config("mnist_logreg", "adam"), steps=3)) == {"plain"}


def test_cli_prints_one_line_per_kind(capsys):
    assert main(["mnist_logreg", "adam", "diagggn_mc:paper", "--steps", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" steps")[0] for line in lines] == [
        "adam plain",
        "diagggn_mc:paper curvature",
    ]
