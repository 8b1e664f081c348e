"""The one-shot GPU check: grpoflow's log-prob kernels and its GRPO trainer on a GPU, in one command that brings
its numbers home whatever happens.

On the GPU machine (one H200; torch, transformers, peft and triton are all it needs; the bare working tree, no
install):

    python benchmarks/gpu_check.py --out $OUT/gpu_check.json          # --budget-s 420 by default
    python benchmarks/gpu_check.py --device cpu --small --out x.json  # the same code on CPU in toy sizes (a test;
                                                                      # the triton cases need TRITON_INTERPRET=1)

The report (--out, JSON) is rewritten atomically (a temporary file, then os.replace) before and after every case:
a kill at any moment leaves every finished number on disk, and the case that was running marked "running". Each
section and each case runs in its own try/except: a failure is recorded with its traceback ("status": "failed",
"reason", "traceback") and the next case runs. Cases not started when the time budget (--budget-s) is spent, or
that need more time than is left, are recorded as "skipped" with the reason. Sections, most valuable first:

1. kernel_correctness: token_logprobs impl="triton" (the compiled Triton kernel) and impl="chunked" against the
   float32 reference (materialized logits, log_softmax) on the same inputs: max error of logp and entropy, max
   error of dH and dW relative to the reference's largest entry; bf16 and float32; frozen and trainable head;
   N x D x V = 1024 x 896 x 151936, then ragged 1001 x 900 x 32003 at temperature 0.7. A case fails when an error
   passes its bound (gpu_check_kernels.TOLERANCE). "bitwise_repeatable": two runs on the same inputs give the
   same bits (recorded, not a failure).
2. grpo: grpoflow's GRPOTrainer on the device (transformers generation, the built-in arithmetic task's rows),
   each case 3 optimizer steps: full fine-tuning of the tiny model (float32 weights, bf16 autocast) and LoRA on a
   bf16 base under bf16 autocast (float32 adapters; the autocast dtype from tasks/model/precision
   lora_autocast_dtype, as loading.compute_dtype gives a real LoRA run): every parameter, gradient, optimizer
   state and round tensor on the device ("all_on_device"), the optimizer stepped, then a checkpoint round trip: a
   fresh trainer resumed from checkpoint-1 (inside a round) must reproduce the uninterrupted run: the next step's
   loss bitwise, the one after within 1e-4, and the completions it samples for its new round token for token
   (torch and CUDA RNG restored): "checkpoint_round_trip_identical". Then a model of Qwen2.5-0.5B's shape (random
   weights, 151936 vocabulary, LoRA r16 on all linear layers, bf16 autocast) for step time, tokens/s and peak
   memory; "entropy_bonus": the same with grpo.entropy_coef 0.01 (the entropy's gradient through the fused
   kernels), its peak beside the run without; "shared_prompt_gradient"; "fsdp2_one_device": FSDP2 as
   tasks/grpo/distributed.py shards (world-size-1 process group: nccl on a GPU, gloo on CPU), 3 accumulated
   micro-steps under bf16 autocast: sharded gradients after every micro-step, no memory growth across them
   (CUDA), the sum equal to the unsharded model's (gpu_check_fsdp.py says what one device cannot show).
3. kernel_timing: N in {2048, 16384} x D in {896, 4096}, V=151936, bf16, frozen and trainable head, side by side:
   triton, chunked, TRL's chunked_logprob ("trl_chunked"), Liger's fused linear cross entropy ("liger_flce"; both
   skipped with "... is not installed" when missing; liger_flce also on CPU: Triton only; TRL's chunked_logprob
   runs there through its torch fallback) and "bare", the matmul floor (Z = H W^T; for fwd+bwd also
   Z W, and Z^T H for a trainable head). "fwd" is the no-grad forward (old and reference log-probs), "fwd_bwd" the
   training forward + backward; timed with CUDA events through triton.testing.do_bench (median; perf_counter on
   CPU); Liger computes its gradients inside its forward, so it has no "fwd" (None, with fwd_note). Peak memory
   above the inputs, from one separate call. The summary gives the time ratios per shape and which of triton and
   chunked is faster; from those the run writes the table impl "auto" reads (kernels/auto_table.py) to
   auto_table.json beside --out, and prints the path and the line that installs it (GRPOFLOW_AUTO_TABLE=path).
4. kernel_tiles: what impl "chunked" does on CUDA between its GEMMs, per [1024, 8192] and [1024, 16384] float32
   logit tile (kernels/tiles.py): the forward's online-softmax fold ("fold/...", e written in bf16) and the
   backward's gradient ("grad/...", G in bf16), each fused (kernels/triton_tiles.py: one read of the tile, one
   16-bit write) against the torch ops it replaces: results compared, both times, the fused kernel's GB/s at 6
   bytes a tile element and the torch/fused ratio. They settle the byte count docs/kernel-roofline.md gives the
   chunked path.
5. grpo_second_gpu: section 2's training cases on cuda:1 when there is one, without torch.cuda.set_device (the
   current device stays cuda:0); records the current device before and after. Last but one: a launch on the
   wrong device can leave the CUDA context unusable.
6. reference_timing: the naive float32 reference at the timing shapes, where memory allows (free memory read
   after torch.cuda.empty_cache: the allocator's cached blocks count as used otherwise).
7. peers: TRL's Triton log-softmax over materialized logits and Liger's fused linear GRPO loss
   (LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, compiled=False): use_ref_model=True asserts without
   reference inputs), timed like section 3 at its first two shapes; skipped with the reason when missing.

Every case prints one line as it ends (ok / FAIL / skipped, and why), so a run lists all of them.

The report's keys: meta (device, versions, budget, whether pydantic was the stand-in), sections (name -> status,
reason, cases: name -> status and numbers), comparisons (section 3's ratios per shape), finished, seconds, and
stopped_by when SIGINT/SIGTERM ended the run. --sections runs a subset; --fail-case NAME makes one case raise (the
tests). The end prints a summary to read in ten seconds: per section what passed, failed or was skipped, the failures'
reasons, and per timing shape which impl is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the helper modules beside this file, however it is started (runpy, -m, a path)

import torch  # noqa: E402
from gpu_check_kernels import Case, Skip, comparisons  # noqa: E402


def _grpoflow_from_the_tree() -> None:
    """A bare checkout (the GPU machine gets the working tree, not an install): expose its flows/, tasks/, kernels/
    and configs/ folders as grpoflow.* through a folder of symlinks, as pyproject's package-dir does installed."""
    try:
        import grpoflow.tasks  # noqa: F401
    except ImportError:
        shim = Path(tempfile.mkdtemp()) / "grpoflow"
        shim.mkdir()
        for name in ("flows", "tasks", "kernels", "configs"):
            (shim / name).symlink_to(HERE.parent / name)
        sys.path.insert(0, str(shim.parent))
        for name in [m for m in sys.modules if m == "grpoflow" or m.startswith("grpoflow.")]:
            del sys.modules[name]


class Report:
    """The JSON report, rewritten whole and atomically (tmp + os.replace) on every change."""

    def __init__(self, path: Path, meta: dict):
        self.path = path
        self.data: dict = {"meta": meta, "finished": False, "sections": {}}
        self.write()

    def write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def _failure(e: BaseException) -> dict:
    return {"status": "failed", "reason": f"{type(e).__name__}: {str(e)[:500]}", "traceback": traceback.format_exc()}


class Runner:
    """Runs sections of cases against a time budget, recording each case as it starts and ends."""

    def __init__(self, report: Report, budget_s: float, fail_case: str | None = None, estimates: bool = True):
        self.report, self.budget_s, self.fail_case = report, budget_s, fail_case
        self.estimates = estimates  # Case.est_s are GPU figures: --small (toy sizes) starts a case while any is left
        self.t0 = time.perf_counter()

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def section(self, name: str, build: Callable[[], list[Case]]) -> None:
        sec = self.report.data["sections"][name] = {"status": "running", "cases": {}}
        t0 = time.perf_counter()
        if self.left() <= 0:
            sec.update(status="skipped", reason=f"time budget spent ({self.budget_s:g} s) before the section")
            self.report.write()
            return
        try:
            cases = build()
        except Exception as e:  # its setup failed: recorded, and the next section runs
            sec.update(_failure(e))
            self.report.write()
            return
        for case in cases:
            self.case(sec["cases"], name, case)
        sec.update(seconds=time.perf_counter() - t0, **_section_status(sec["cases"]))
        self.report.write()

    def case(self, into: dict, section: str, case: Case) -> None:
        left = self.left()
        if left <= 0 or (self.estimates and left < case.est_s):
            why = "spent" if left <= 0 else f"{left:.0f} s left, the case needs about {case.est_s:.0f} s"
            into[case.name] = {"status": "skipped", "reason": f"time budget ({self.budget_s:g} s): {why}"}
            self.report.write()
            self.announce(section, case.name, into[case.name])
            return
        into[case.name] = {"status": "running"}
        self.report.write()
        t0 = time.perf_counter()
        try:
            if self.fail_case in (case.name, f"{section}/{case.name}"):
                raise RuntimeError(f"--fail-case {self.fail_case}: this case fails on purpose")
            rec = case.run()
            rec = {"status": rec.pop("status", "passed"), **rec}
        except Skip as e:
            rec = {"status": "skipped", "reason": str(e)}
        except Exception as e:
            rec = _failure(e)
        except KeyboardInterrupt as e:  # SIGINT or SIGTERM: this case's record says so, then the run stops
            into[case.name] = {**_failure(e), "reason": "interrupted", "case_seconds": time.perf_counter() - t0}
            self.report.write()
            raise
        rec["case_seconds"] = time.perf_counter() - t0
        into[case.name] = rec
        self.report.write()
        self.announce(section, case.name, rec)

    def announce(self, section: str, name: str, rec: dict) -> None:
        """One line per case as it ends: ok, FAIL or skipped, and why (every case of a run is listed)."""
        word = {"passed": "ok", "failed": "FAIL", "skipped": "skipped"}.get(rec["status"], rec["status"])
        why = f": {rec['reason'][:200]}" if rec.get("reason") and rec["status"] != "passed" else ""
        print(f"    {word:7s} {section}/{name}{why}", flush=True)


def _section_status(cases: dict) -> dict:
    states = [c["status"] for c in cases.values()]
    failed = [n for n, c in cases.items() if c["status"] == "failed"]
    if failed:
        return {"status": "failed", "reason": f"{len(failed)} case(s) failed: {', '.join(failed)}"}
    if states and all(s == "skipped" for s in states):
        return {"status": "skipped", "reason": next(iter(cases.values()))["reason"]}
    return {"status": "passed"}


# ---------------------------------------------------------------------------------------------- summary
def summary(report: dict) -> list[str]:
    lines = ["", "gpu_check summary"]
    for name, sec in report["sections"].items():
        counts = {}
        for c in sec.get("cases", {}).values():
            counts[c["status"]] = counts.get(c["status"], 0) + 1
        tally = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or sec.get("reason", "")
        lines.append(f"  {name:20s} {sec['status'].upper():8s} {tally}")
        for cname, c in sec.get("cases", {}).items():
            if c["status"] == "failed":
                lines.append(f"      FAILED {cname}: {c['reason'][:160]}")
        if name == "kernel_correctness":
            for impl in ("triton", "chunked"):
                flags = [c.get("bitwise_repeatable") for n, c in sec["cases"].items() if n.startswith(impl + "/")]
                flags = [f for f in flags if f is not None]
                if flags:
                    lines.append(f"      {impl}: bitwise repeatable in {sum(flags)}/{len(flags)} cases")
        if name == "kernel_tiles":
            for cname, c in sec.get("cases", {}).items():
                if c["status"] == "passed":
                    lines.append(
                        f"      {cname}: fused {c['fused_ms']:.3f} ms ({c['fused_gb_per_s']:.0f} GB/s), torch ops "
                        f"{c['torch_ms']:.3f} ms: {c['torch_over_fused']:.1f}x"
                    )
        if name.startswith("grpo"):
            for cname, c in sec.get("cases", {}).items():
                if c["status"] in ("passed", "failed") and "steps" in c:
                    rt = c.get("checkpoint_round_trip_identical", "(not checked)")
                    lines.append(
                        f"      {cname}: {c['steps']} steps, {c['step_seconds']:.2f} s/step, on device "
                        f"{c['all_on_device']}, checkpoint round trip identical {rt}"
                    )
                if c["status"] in ("passed", "failed") and "one_forward_over_planned" in c:
                    lines.append(
                        f"      {cname}: planned {c['planned_ms']:.1f} ms vs one forward {c['one_forward_ms']:.1f} ms "
                        f"({c['one_forward_over_planned']:.2f}x), {c['rows_with_gradient']}/{c['rows']} rows with a "
                        f"gradient, gradients differ by {c['gradient_rel_diff']:.2g}"
                    )
    timing = report["sections"].get("kernel_timing", {}).get("cases", {})
    rows = comparisons(timing)
    if rows:
        dtype = next(c["dtype"] for c in timing.values() if c.get("status") == "passed")
        lines.append(f"  timing, {dtype}, training pass (fwd+bwd ms; time ratios)")
        for r in rows:
            got = {n.split("/")[0]: c for n, c in timing.items() if c.get("status") == "passed" and _same(c, r)}
            ms = "  ".join(f"{k} {c['fwd_bwd_ms']:.1f}" for k, c in got.items())
            ratio = {k.removesuffix("_fwd_bwd"): v for k, v in r.items() if "/" in k and k.endswith("_fwd_bwd")}
            ratios = "  ".join(f"{k} {v:.2f}" for k, v in ratio.items())
            faster = f" -> {r['faster_fwd_bwd']} faster" if "faster_fwd_bwd" in r else ""
            lines.append(f"    {r['N']:>6d}x{r['D']:<5d} {r['head']:9s} {ms} | {ratios}{faster}")
    return lines


def _same(case: dict, row: dict) -> bool:
    return all(case.get(k) == row[k] for k in ("N", "D", "V", "head"))


def print_table(report: dict) -> None:
    timing = report["sections"].get("kernel_timing", {}).get("cases", {})
    passed = {n: c for n, c in timing.items() if c.get("status") == "passed"}
    if passed:
        print(f"\n  {'case':34s} {'fwd ms':>9s} {'fwd+bwd ms':>11s} {'fwd GB':>8s} {'fwd+bwd GB':>11s}")
        for n, c in passed.items():
            gb = [("-" if x is None else f"{x:.3f}") for x in (c["fwd_peak_gb"], c["fwd_bwd_peak_gb"])]
            fwd = "-" if c["fwd_ms"] is None else f"{c['fwd_ms']:.2f}"
            print(f"  {n:34s} {fwd:>9s} {c['fwd_bwd_ms']:11.2f} {gb[0]:>8s} {gb[1]:>11s}")


# ---------------------------------------------------------------------------------------------- auto table
def write_auto_table(report: dict, path: Path) -> dict | None:
    """The table ``impl="auto"`` reads (kernels/auto_table.py) from this run's timing: per shape and head, the
    faster of triton and chunked in the no-grad forward and in the training pass; written to ``path`` when at
    least one shape had both timed. Returns what the report records (path, entries, how to install it)."""
    _grpoflow_from_the_tree()
    from grpoflow.kernels.auto_table import ENV, table_from_timings

    timing = report["sections"].get("kernel_timing", {}).get("cases", {})
    rows = [r for r in report.get("comparisons", []) if "faster_fwd_bwd" in r]
    if not rows:
        return None
    dtype = next(c["dtype"] for c in timing.values() if c.get("status") == "passed")
    meta = report["meta"]
    source = f"benchmarks/gpu_check.py on {meta['device_name']} ({meta['device']}), {meta['started']}"
    if meta.get("small"):
        source += ", --small toy shapes: a test of the machinery, not a table for a GPU"
    table = table_from_timings(rows, dtype, meta["device_name"], source)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(table, indent=1))
    os.replace(tmp, path)
    return {"status": "written", "path": str(path), "entries": len(table["entries"]), "install": f"{ENV}={path}"}


def auto_table_line(rec: dict | None) -> str:
    if rec is None:
        return "auto table: not written (no shape had both triton and chunked timed)"
    if rec.get("status") != "written":
        return f"auto table: FAILED {rec.get('reason')}"
    return (
        f"auto table ({rec['entries']} shapes) -> {rec['path']}; to make impl=auto use it: "
        f"export {rec['install']} (or copy its entries into kernels/auto_table.py DEFAULT_TABLE)"
    )


# ---------------------------------------------------------------------------------------------- main
def _versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "transformers", "peft"):
        try:
            out[name] = __import__(name).__version__
        except Exception as e:  # recorded, not fatal: the sections that need it fail with their own reason
            out[name] = f"unavailable: {type(e).__name__}"
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (cuda:0), cuda:N or cpu")
    p.add_argument("--small", action="store_true", help="toy sizes (the CPU test)")
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--budget-s", type=float, default=420.0, help="total time budget (default 420: 7 minutes)")
    p.add_argument("--repeats", type=int, default=None, help="timed repetitions per case (default 3; 1 --small)")
    p.add_argument("--sections", default=None, help="comma-separated subset of the sections, in the usual order")
    p.add_argument("--fail-case", default=None, help="(tests) make this case (name or section/name) raise")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: --device cuda, but torch sees no GPU (on CPU: --device cpu --small)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    repeats = a.repeats or (1 if a.small else 3)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a kill by timeout records the running case
    os.environ.setdefault("GRPOFLOW_PROGRESS", "0")
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means IEEE float32 (the reference, fp32 cases)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    meta = {
        "device": str(device),
        "device_name": name,
        "gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
        "argv": sys.argv[1:] if argv is None else argv,
        "budget_s": a.budget_s,
        "small": a.small,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        **_versions(),
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = Report(out, meta)
    runner = Runner(report, a.budget_s, a.fail_case, estimates=not a.small)
    print(f"gpu_check: {name} ({device}), torch {torch.__version__}, budget {a.budget_s:g} s -> {out}", flush=True)
    sections = build_sections(device, a.small, repeats)
    chosen = a.sections.split(",") if a.sections else list(sections)
    unknown = set(chosen) - set(sections)
    if unknown:
        sys.exit(f"gpu_check: unknown sections {sorted(unknown)}; known: {', '.join(sections)}")
    try:
        for sec_name in [s for s in sections if s in chosen]:
            print(f"[{time.perf_counter() - runner.t0:6.1f} s] {sec_name}", flush=True)
            runner.section(sec_name, sections[sec_name])
    except BaseException as e:  # SIGINT/SIGTERM (the running case says so): the sections after it are absent
        report.data["stopped_by"] = type(e).__name__
        raise
    finally:
        stand_in = getattr(sys.modules.get("pydantic"), "GPU_CHECK_STAND_IN", False)
        report.data["meta"]["pydantic"] = "stand-in (gpu_check_nopydantic)" if stand_in else "installed or unused"
        report.data["finished"] = True
        report.data["seconds"] = time.perf_counter() - runner.t0
        report.data["comparisons"] = comparisons(report.data["sections"].get("kernel_timing", {}).get("cases", {}))
        try:  # the measured auto table beside the report (nothing when no shape had both impls timed)
            report.data["auto_table"] = write_auto_table(report.data, out.with_name("auto_table.json"))
        except Exception as e:
            report.data["auto_table"] = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
        report.write()
        try:  # the report is on disk already: a fault in printing it must not hide it
            print_table(report.data)
            print("\n".join(summary(report.data)))
            print(auto_table_line(report.data.get("auto_table")))
        except Exception:
            traceback.print_exc()
        print(f"wrote {out}")
    return report.data


def build_sections(device, small: bool, repeats: int) -> dict[str, Callable[[], list[Case]]]:
    """Section name -> a function building its cases (in the order they run). Importing grpoflow and the pydantic
    stand-in happens inside, so that a failure there is a section's failure, recorded."""

    def grpo(second: bool):
        def build():
            _grpoflow_ready()
            import gpu_check_grpo as g

            return g.second_device_cases(device, small) if second else g.grpo_cases(device, small)

        return build

    def kernels(make):
        def build():
            _grpoflow_ready()
            return make()

        return build

    import gpu_check_kernels as k

    return {
        "kernel_correctness": kernels(lambda: k.correctness_cases(device, small)),
        "grpo": grpo(False),
        "kernel_timing": kernels(lambda: k.timing_cases(device, small, repeats)),
        "kernel_tiles": kernels(lambda: k.tile_cases(device, small, repeats)),
        "grpo_second_gpu": grpo(True),
        "reference_timing": kernels(lambda: k.reference_timing_cases(device, small, repeats)),
        "peers": kernels(lambda: k.peer_cases(device, small, repeats)),
    }


def _grpoflow_ready() -> None:
    """grpoflow importable from the tree, its config sections definable without pydantic (the GPU machine has
    none: gpu_check_nopydantic stands in)."""
    _grpoflow_from_the_tree()
    import gpu_check_nopydantic

    gpu_check_nopydantic.install()


if __name__ == "__main__":
    main()
