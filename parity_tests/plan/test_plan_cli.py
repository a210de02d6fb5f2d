"""``jaxmem.planner.cli.main``: a user's module:function planned from the command line."""
import json

from jaxmem.planner.cli import main

USER = '''
import jax, jax.numpy as jnp, flax.linen as nn

class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = nn.tanh(nn.Dense(64, name=f"d{i}")(x))
        return nn.Dense(1, name="head")(x)

def make():
    m = Net()
    x = jax.random.normal(jax.random.key(0), (256, 64))
    p = m.init(jax.random.key(1), x)
    return (lambda p, x: jnp.mean(m.apply(p, x) ** 2)), (p, x)
'''


def test_plan_cli_unreachable_budget_writes_json(tmp_path, monkeypatch, capsys):
    (tmp_path / "plan_cli_user.py").write_text(USER)
    monkeypatch.chdir(tmp_path)
    rc = main(["plan_cli_user:make", "--budget", "1KiB", "--out", str(tmp_path / "o")])
    assert rc == 2
    d = json.loads((tmp_path / "o" / "plan.json").read_text())
    assert "cannot be met" in d["error"] and d["smallest_bytes"] > 1024
    # what is live at the smallest plan's peak, on screen and in the JSON
    assert "at that plan's peak: LivePeak(" in capsys.readouterr().out
    peak = d["smallest_peak"]
    assert 0 < peak["live_bytes"] <= peak["temp_bytes"] < d["smallest_bytes"]
    assert peak["largest"] and peak["largest"][0]["bytes"] <= peak["live_bytes"]


def test_plan_cli_refuses_a_bad_logits_chunk(tmp_path, monkeypatch, capsys):
    (tmp_path / "plan_cli_user.py").write_text(USER)
    monkeypatch.chdir(tmp_path)
    for bad in ("0", "-2", "x"):
        try:
            main(["plan_cli_user:make", "--budget", "0.5", "--logits-chunk", bad])
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(f"--logits-chunk {bad} was accepted")
        assert "--logits-chunk" in capsys.readouterr().err
