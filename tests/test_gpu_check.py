"""benchmarks/gpu_check.py in its CPU mode, as the GPU machine would run it: from the bare tree (grpoflow not
installed: its import finder removed), with none of the packages that machine lacks (pydantic, rich, vLLM, Prefect,
MLflow, datasets, bitsandbytes, boto3, TRL, Liger: importing them fails), the Triton kernel under the interpreter.
Only the GPU can show the compiled kernel's errors and speed, cuda:1 and the CUDA RNG round trip; here the same code
runs end to end in toy sizes, and the report's machinery (atomic rewrites, failures, budget) is checked in full."""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
ABSENT = ("pydantic", "rich", "vllm", "prefect", "mlflow", "datasets", "bitsandbytes", "boto3", "trl", "liger_kernel")
SECTIONS = (
    "kernel_correctness", "grpo", "kernel_timing", "kernel_tiles", "grpo_second_gpu", "reference_timing", "peers",
)  # fmt: skip

PRELUDE = f"""
import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
for name in {ABSENT!r}:
    sys.modules[name] = None
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_check(tmp_path, *args, timeout=400) -> tuple[dict, subprocess.CompletedProcess]:
    out = tmp_path / "check.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)  # the bare tree: grpoflow comes from the script's own shim
    cmd = [sys.executable, "-c", PRELUDE, str(SCRIPT), "--device", "cpu", "--small", "--out", str(out), *args]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return json.loads(out.read_text()), res


def cases(report: dict) -> list[tuple[str, str, dict]]:
    """(section, case, record) in the order they ran."""
    return [(s, n, c) for s, sec in report["sections"].items() for n, c in sec.get("cases", {}).items()]


def test_gpu_check_cpu_mode_from_the_bare_tree(tmp_path):
    report, res = run_check(tmp_path)
    assert report["finished"] and tuple(report["sections"]) == SECTIONS
    for name, sec in report["sections"].items():
        assert sec["status"] in ("passed", "failed", "skipped"), (name, sec)
        assert sec["status"] == "passed" or sec["reason"], (name, sec)
        for case, c in sec.get("cases", {}).items():
            assert c["status"] == "passed" or c["reason"], (name, case, c)

    correct = report["sections"]["kernel_correctness"]
    assert correct["status"] == "passed", correct
    assert len(correct["cases"]) == 16  # 2 impls x 2 dtypes x 2 heads x (regular, ragged)
    for name, c in correct["cases"].items():
        fp32 = c["dtype"] == "fp32"
        assert c["logp_max_err"] < (1e-4 if fp32 else 0.1) and c["dH_rel_err"] < (1e-4 if fp32 else 0.05), (name, c)
        assert ("trainable" in name) == ("dW_rel_err" in c), name
        assert c["bitwise_repeatable"] is True, name
    assert {c["V"] for c in correct["cases"].values()} == {256, 301}

    grpo = report["sections"]["grpo"]
    assert grpo["status"] == "passed", grpo
    for kind in ("full_bf16_autocast", "lora"):
        g = grpo["cases"][kind]
        assert g["all_on_device"] and g["weights_changed"] and g["optimizer_steps"] == g["steps"] == 3, g
        assert g["checkpoint_round_trip_identical"] and g["round_saved"], g
        assert g["first_loss_identical"] and g["new_round_tokens_identical"] and g["later_losses_max_diff"] == 0.0, g
    # LoRA on a bf16 base trains under bf16 autocast, as a real run does (loading.compute_dtype)
    for kind in ("full_bf16_autocast", "lora", "qwen_shape_lora", "entropy_bonus"):
        assert grpo["cases"][kind]["autocast"] == "bfloat16", kind
    assert grpo["cases"]["lora"]["weights_dtype"] == "float32"  # the adapters; the base is bf16
    assert grpo["cases"]["lora"]["trainable"] < grpo["cases"]["lora"]["parameters"]
    assert grpo["cases"]["qwen_shape_lora"]["all_on_device"]
    bonus = grpo["cases"]["entropy_bonus"]
    assert bonus["entropy_coef"] == 0.01 and bonus["weights_changed"] and bonus["optimizer_steps"] == 3, bonus
    assert bonus["losses"] != grpo["cases"]["qwen_shape_lora"]["losses"]  # the bonus is in the loss
    shared = grpo["cases"]["shared_prompt_gradient"]
    assert shared["expand_rows_repeatable"] and shared["index_select_repeatable"], shared  # the CPU op it picks
    planned = grpo["cases"]["planned_pass"]  # the loss pass as micro_plan.py plans it: the same gradients
    assert planned["rows_with_gradient"] == planned["rows"] // 2 and planned["gradient_rel_diff"] < 1e-3, planned
    assert planned["planned_ms"] > 0 and planned["one_forward_ms"] > 0, planned
    fsdp = grpo["cases"]["fsdp2_one_device"]
    assert fsdp["backend"] == "gloo" and fsdp["grads_sharded_after_each_micro_step"] == [True, True, True], fsdp
    assert fsdp["grad_rel_err_vs_unsharded"] < 0.1 and fsdp["sharded_grad_bytes"] > 0, fsdp
    # the bound tells a lost micro-step apart: the sum without one is off by more than the tolerance
    assert fsdp["lost_micro_step_rel_err"] > fsdp["tolerance"] > fsdp["grad_rel_err_vs_unsharded"], fsdp

    timing = report["sections"]["kernel_timing"]
    assert timing["status"] == "passed" and len(timing["cases"]) == 4 * 2 * 5
    for name, c in timing["cases"].items():
        impl = name.split("/")[0]
        if impl in ("trl_chunked", "liger_flce"):  # blocked here, as on a GPU machine without them
            assert c["status"] == "skipped" and c["reason"] in ("trl is not installed", "liger_kernel is not installed")
        else:
            assert c["status"] == "passed" and c["fwd_ms"] > 0 and c["fwd_bwd_ms"] > 0, (name, c)
            assert c["timer"] == "perf_counter", c
    rows = report["comparisons"]
    assert len(rows) == 8 and all(r["faster_fwd_bwd"] in ("triton", "chunked") for r in rows)
    assert all(r["triton/chunked_fwd_bwd"] > 0 and r["chunked/bare_fwd"] > 0 for r in rows)
    assert all(r["fastest_fwd_bwd"] in ("triton", "chunked") for r in rows)

    # the auto table the run wrote: impl=auto reads the measured choice back; the interpreted Triton kernel loses to
    # the chunked path at every toy shape, so every entry says chunked
    from grpoflow.kernels.auto_table import choose, load_table

    written = report["auto_table"]
    assert written["status"] == "written" and written["install"] == f"GRPOFLOW_AUTO_TABLE={written['path']}"
    table = load_table(written["path"])
    assert len(table["entries"]) == 8 and "--small" in table["source"]
    for r in rows:
        for mode in ("fwd", "fwd_bwd"):
            got = choose(r["N"], r["D"], r["V"], "float32", r["head"], mode, table)
            assert got == r[f"faster_{mode}"] == "chunked", (r, mode)
    assert f"export GRPOFLOW_AUTO_TABLE={written['path']}" in res.stdout

    # the tile kernels: fused (interpreted Triton) agree with the torch ops they replace, both timed
    tiles = report["sections"]["kernel_tiles"]
    assert tiles["status"] == "passed", tiles
    assert set(tiles["cases"]) == {f"{k}/{t}" for k in ("fold", "grad") for t in ("16x300", "8x64")}, tiles
    for c in tiles["cases"].values():
        assert c["max_err"] <= 2**-7 and c.get("max_state_err", 0) < 1e-3, c  # within one bf16 step
        assert c["fused_ms"] > 0 and c["torch_ms"] > 0 and c["fused_gb_per_s"] > 0 and c["torch_over_fused"] > 0, c

    assert report["sections"]["grpo_second_gpu"]["status"] == "skipped"
    peers = report["sections"]["peers"]
    assert peers["status"] == "skipped" and all("not installed" in c["reason"] for c in peers["cases"].values())
    assert set(peers["cases"]) == {
        f"{p}/frozen/{s}" for p in ("trl_triton", "liger") for s in ("64x32x300", "128x64x300")
    }
    assert report["sections"]["reference_timing"]["status"] == "passed"

    # every case of the run is listed with its status as it ends
    for sec, name, c in cases(report):
        word = {"passed": "ok", "failed": "FAIL", "skipped": "skipped"}[c["status"]]
        assert f"{word:7s} {sec}/{name}" in res.stdout, (sec, name)

    summary = res.stdout[res.stdout.index("gpu_check summary") :]
    assert "kernel_correctness   PASSED" in summary and " faster" in summary
    assert "kernel_tiles         PASSED" in summary and "grad/16x300: fused" in summary
    assert "grpo_second_gpu      SKIPPED" in summary


def test_the_liger_peer_has_no_forward_only_time_and_builds_without_a_reference_model(monkeypatch):
    """Liger computes its gradients inside its forward: the check reports no "fwd" for it (the old one timed a
    forward + backward), and builds its GRPO loss with use_ref_model=False (True asserts without reference
    inputs). Liger is not installed here: a stand-in module records the constructor's arguments."""
    import types

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_check_kernels as k
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    built = {}

    class FakeGRPOLoss:
        def __init__(self, **kw):
            built.update(kw)

        def __call__(self, h, w, y, mask, adv):
            assert h.dim() == 3 and y.shape == mask.shape == h.shape[:2] and adv.shape == (h.shape[0],)
            return ((h.float() @ w.float().t()).logsumexp(-1) * mask).sum(), []

    chunked = types.ModuleType("liger_kernel.chunked_loss")
    chunked.LigerFusedLinearGRPOLoss = FakeGRPOLoss
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.chunked_loss", chunked)
    rec = k.timing_case("liger", 16, 8, 32, False, torch.device("cpu"), 1)
    assert built == {"beta": 0.0, "use_ref_model": False, "compiled": False}
    assert rec["fwd_ms"] is None and "inside its forward" in rec["fwd_note"] and rec["fwd_bwd_ms"] > 0
    with pytest.raises(ValueError, match="no forward-only pass"):
        k.one_pass("liger", *k.inputs(16, 8, 32, torch.float32, torch.device("cpu"), False), backward=False)


def test_a_failing_case_is_recorded_and_the_next_sections_run(tmp_path):
    victim = "kernel_correctness/triton/bf16/frozen/64x64x256"
    report, res = run_check(tmp_path, "--fail-case", victim, "--sections", "kernel_correctness,grpo_second_gpu,peers")
    sec = report["sections"]["kernel_correctness"]
    failed = sec["cases"]["triton/bf16/frozen/64x64x256"]
    assert failed["status"] == "failed" and "--fail-case" in failed["reason"]
    assert "RuntimeError" in failed["traceback"] and "Traceback" in failed["traceback"]
    assert sec["status"] == "failed" and "triton/bf16/frozen/64x64x256" in sec["reason"]
    others = [c for n, c in sec["cases"].items() if n != "triton/bf16/frozen/64x64x256"]
    assert len(others) == 15 and all(c["status"] == "passed" for c in others)
    assert tuple(report["sections"]) == ("kernel_correctness", "grpo_second_gpu", "peers") and report["finished"]
    assert "FAILED triton/bf16/frozen/64x64x256" in res.stdout


def test_a_spent_budget_skips_the_rest_with_the_reason(tmp_path):
    report, _ = run_check(tmp_path, "--budget-s", "2", "--sections", "kernel_correctness,kernel_timing,grpo")
    assert tuple(report["sections"]) == ("kernel_correctness", "grpo", "kernel_timing") and report["finished"]
    states = [c["status"] for _, _, c in cases(report)]
    # what ran before the budget was spent passed; nothing after it ran. The budget may run out between two
    # sections: then no case is skipped, the next sections are (with no cases recorded)
    first_skip = states.index("skipped") if "skipped" in states else len(states)
    assert set(states[:first_skip]) <= {"passed"} and set(states[first_skip:]) <= {"skipped"}
    assert first_skip < len(states) or any(s["status"] == "skipped" for s in report["sections"].values())
    for sec, name, c in cases(report)[first_skip:]:
        assert c["reason"].startswith("time budget (2 s)"), (sec, name, c)
    for sec in report["sections"].values():
        assert sec["status"] in ("passed", "skipped") and (sec["status"] == "passed" or "time budget" in sec["reason"])
    assert report["seconds"] < 60


# ---------------------------------------------------------------------------------------------- in-process parts
def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_report_on_disk_holds_every_finished_case_while_the_next_runs(tmp_path):
    """A kill at any moment: each case reads the file as it runs and finds every earlier case's numbers, itself
    marked running; a failing case keeps its traceback; an interrupt marks the case and stops the run."""
    gc = load_script()
    path = tmp_path / "r.json"
    report = gc.Report(path, {"x": 1})
    seen = []

    def look(i):
        on_disk = json.loads(path.read_text())["sections"]["s"]["cases"]
        seen.append({n: c["status"] for n, c in on_disk.items()})
        if i == 1:
            raise ValueError("boom")
        return {"value": i}

    runner = gc.Runner(report, budget_s=100)
    runner.section("s", lambda: [gc.Case(f"c{i}", lambda i=i: look(i)) for i in range(3)])
    assert seen == [
        {"c0": "running"},
        {"c0": "passed", "c1": "running"},
        {"c0": "passed", "c1": "failed", "c2": "running"},
    ]
    final = json.loads(path.read_text())["sections"]["s"]
    assert final["status"] == "failed" and "c1" in final["reason"] and final["cases"]["c2"]["value"] == 2
    assert "ValueError: boom" in final["cases"]["c1"]["traceback"]
    assert not list(tmp_path.glob("*.tmp"))  # written through a temporary file, renamed

    runner.section("broken", lambda: 1 / 0)  # a section whose setup raises: recorded, the run goes on
    assert json.loads(path.read_text())["sections"]["broken"]["reason"].startswith("ZeroDivisionError")

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runner.section("t", lambda: [gc.Case("k", interrupted), gc.Case("never", lambda: {})])
    t = json.loads(path.read_text())["sections"]["t"]
    assert t["cases"]["k"]["reason"] == "interrupted" and "never" not in t["cases"]


def test_the_budget_spent_mid_section_skips_the_cases_left_and_the_next_sections(tmp_path):
    gc = load_script()
    runner = gc.Runner(gc.Report(tmp_path / "r.json", {}), budget_s=0.3)
    runner.section("s", lambda: [gc.Case(f"c{i}", lambda: time.sleep(0.2) or {}) for i in range(4)])
    runner.section("later", lambda: [gc.Case("x", lambda: {})])
    got = json.loads((tmp_path / "r.json").read_text())["sections"]
    assert [c["status"] for c in got["s"]["cases"].values()] == ["passed", "passed", "skipped", "skipped"]
    assert got["s"]["cases"]["c2"]["reason"] == "time budget (0.3 s): spent" and got["s"]["status"] == "passed"
    assert got["later"]["status"] == "skipped" and "before the section" in got["later"]["reason"]


def test_a_case_longer_than_the_budget_left_is_not_started(tmp_path):
    gc = load_script()
    runner = gc.Runner(gc.Report(tmp_path / "r.json", {}), budget_s=50)
    ran = []
    runner.section("s", lambda: [gc.Case("big", lambda: ran.append(1) or {}, est_s=60), gc.Case("ok", lambda: {})])
    got = json.loads((tmp_path / "r.json").read_text())["sections"]["s"]["cases"]
    assert not ran and got["big"]["status"] == "skipped" and "needs about 60 s" in got["big"]["reason"]
    assert got["ok"]["status"] == "passed"


STAND_IN = """
import json, sys
sys.modules["pydantic"] = None
sys.path.insert(0, sys.argv[1])
import gpu_check_nopydantic
assert gpu_check_nopydantic.install()
from grpoflow.tasks.config import GRPOConfig, LoraConfig, TinyModelConfig
out = []
for kw in json.loads(sys.argv[2]):
    c = GRPOConfig(**kw)
    out.append([c.model_dump(mode="json"), c.batching().__dict__, c.effective_epsilon_high])
errors = []
for bad in ({"no_such_key": 1}, {"steps_per_generation": 2, "generation_batch_size": 16}, {"num_generations": 1}):
    try:
        GRPOConfig(**bad)
    except ValueError as e:
        errors.append(str(e))
out.append([LoraConfig(target_modules="all-linear").model_dump(), TinyModelConfig(hidden_size=64).model_dump()])
print(json.dumps({"dumps": out, "errors": errors}))
"""


def test_the_pydantic_stand_in_builds_the_configs_real_pydantic_builds():
    """The GPU machine has no pydantic: grpoflow's own config classes are defined on the stand-in, and must give
    the trainer the same settings (the config hash included) as with pydantic."""
    from grpoflow.tasks.config import GRPOConfig, LoraConfig, TinyModelConfig

    kws = [
        {},
        {"max_steps": 3, "per_device_train_batch_size": 8, "generation_batch_size": 16, "num_generations": 4},
        {"learning_rate": 1, "epsilon_high": 0.28, "vllm_importance_sampling_clip_max": 3.0, "loss_type": "grpo"},
        {"gradient_accumulation_steps": 4, "steps_per_generation": 2, "reward_funcs": ["correctness"]},
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-c", STAND_IN, str(REPO / "benchmarks"), json.dumps(kws)]
    res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    for kw, (dump, batching, eps_high) in zip(kws, got["dumps"]):
        real = GRPOConfig(**kw)
        assert dump == real.model_dump(mode="json"), kw
        assert json.dumps(dump, sort_keys=True) == json.dumps(real.model_dump(mode="json"), sort_keys=True), kw
        assert batching == real.batching().model_dump() and eps_high == real.effective_epsilon_high
    lora, tiny = got["dumps"][-1]
    assert lora == LoraConfig(target_modules="all-linear").model_dump()
    assert tiny == TinyModelConfig(hidden_size=64).model_dump()
    unknown, exclusive, g = got["errors"]
    assert "no_such_key" in unknown and "mutually exclusive" in exclusive and "num_generations" in g


def test_the_round_trip_check_catches_a_checkpoint_that_loses_the_rng(monkeypatch):
    """The comparison has teeth: with the RNG restore taken out of checkpoint loading, run B samples other
    completions and the case fails."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_check_grpo as g
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # the reward 'gpu_check_grpo:digit_share' imports
    setup = g.Setup()
    monkeypatch.setattr(torch, "set_rng_state", lambda state: None)
    out = g.grpo_case("lora", setup, torch.device("cpu"), small=True)
    assert out["status"] == "failed" and not out["new_round_tokens_identical"]
    assert out["losses_after_resume"]["2"][0] == out["losses_after_resume"]["2"][1]  # the restored round itself
