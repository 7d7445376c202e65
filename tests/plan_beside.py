"""What a rehearsed rank disagrees on with its plan (the FP8 rehearsal tests share it)."""
from __future__ import annotations

STATES = ("params", "grads", "optimizer")


def misses(r: dict, tol: float) -> list[str]:
    """What disagrees: a model state not equal to the byte, activations or an axis's bytes off by ``tol``."""
    out = [k for k in STATES if r["memory_bytes"][k] != r["plan_memory_bytes"][k]]
    if abs(r["ratios"]["activations"] - 1) > tol:
        out.append("activations")
    return out + [ax for ax, x in r["ratios"]["comm"].items() if x is None or abs(x - 1) > tol]


def replanned(case: tuple) -> dict:
    """The rank's measured figures beside the plan's, recomputed now (a planted error shows here)."""
    cfg, plan, r = case
    from paralayer.rehearse.driver import beside_the_plan, rehearsal_config

    return beside_the_plan(rehearsal_config(cfg, plan)[0], plan, r)


def rehearse_cases(base: list[str], cases: dict, plan_ok=lambda plan: True) -> dict:
    """name -> (cfg, plan, rank 0's rehearsal) for each case's overrides on ``base``; each plan must be a
    valid FP8 plan that ``plan_ok`` accepts, and each rehearsal must run."""
    from paralayer import config as config_mod
    from paralayer import rehearse as R
    from paralayer.resolve import resolve

    out = {}
    for name, extra in cases.items():
        cfg = config_mod.load_config(base + extra)
        plan = resolve(cfg).to_dict()
        assert not plan["errors"] and plan["fp8"] and plan_ok(plan), plan["errors"]
        run = R.rehearse(cfg, plan, [0])
        assert run["ok"], run
        out[name] = (cfg, plan, run["ranks"][0])
    return out
