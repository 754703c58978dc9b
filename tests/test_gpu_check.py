"""``benchmarks/gpu_check.sh`` and its package ``benchmarks/gpu_check/``: arguments, the no-CUDA exit, the
report, and every arm's training step on the tiny shape on CPU (float32).

The ``test_on_cuda_*`` tests are the CUDA tests ``benchmarks/gpu_check.sh`` runs first on a GPU machine
(``-k on_cuda``); without CUDA they are skipped.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests._benchmark_scripts import load_benchmark_package

load_benchmark_package("gpu_check")
from gpu_check import arms, cli, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: benchmarks/gpu_check.sh runs it")
without_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour on a machine without CUDA")
TINY = ["--shape", "tiny", "--steps", "2", "--warmup", "1", "--seq-len", "32"]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gpu_check") / "tiny"
    arms.save_random_init(arms.model_config("tiny"), folder, torch.float32, torch.device("cpu"))
    return folder


# ------------------------------------------------------------------------------------------ arguments
def test_defaults_are_the_issue_settings() -> None:
    args = cli.parse_args([])
    assert (args.steps, args.warmup, args.arms, args.seq_len, args.shape) == (20, 3, arms.ARMS, 256, "qwen2.5_0.5b")
    assert (args.out, args.device, args.lcsb_backward, args.preflight) == (Path("gpu_check.json"), "cuda", "all_reached", False)


def test_arguments_are_parsed() -> None:
    args = cli.parse_args(["--steps", "4", "--warmup", "1", "--arms", "mebp, mebp_lcsb", "--out", "r/x.json",
                                 "--seq-len", "64", "--shape", "tiny", "--lcsb-backward", "identity", "--device", "cpu"])
    assert (args.steps, args.warmup, args.arms, args.out) == (4, 1, ("mebp", "mebp_lcsb"), Path("r/x.json"))
    assert (args.seq_len, args.shape, args.lcsb_backward, args.device) == (64, "tiny", "identity", "cpu")


@pytest.mark.parametrize(("argv", "named"), [
    (["--steps", "0"], "--steps"), (["--steps", "two"], "--steps"), (["--warmup", "0"], "--warmup"),
    (["--arms", "qlora,lora"], "--arms"), (["--arms", "mebp,mebp"], "--arms"), (["--arms", " , "], "--arms"),
    (["--seq-len", "1"], "--seq-len"), (["--shape", "llama-70b"], "--shape"), (["--lcsb-backward", "none"], "--lcsb-backward"),
    (["--bogus"], "--bogus"),
])
def test_bad_arguments_exit_2_naming_the_option(argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(argv)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


# ------------------------------------------------------------------------------------- without CUDA
@pytest.mark.parametrize(("build", "hint"), [(None, "CPU-only build"), ("12.8", "CUDA_VISIBLE_DEVICES")])
def test_no_cuda_returns_2_with_a_message(build: str | None, hint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", build)
    assert cli.main([*TINY, "--out", str(tmp_path / "r.json")]) == cli.NO_CUDA_EXIT == 2
    err = capsys.readouterr().err
    assert "torch.cuda.is_available() is False" in err and hint in err
    assert not (tmp_path / "r.json").exists()


def test_preflight_checks_without_running(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--preflight", "--device", "cpu", "--out", str(tmp_path / "r.json")]) == 0
    assert "preflight ok" in capsys.readouterr().out and not (tmp_path / "r.json").exists()


@without_cuda
def test_module_exits_2_without_cuda() -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", *TINY], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "torch.cuda.is_available()" in done.stderr


def test_script_syntax() -> None:
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr


@without_cuda
def test_script_fails_fast_without_cuda(tmp_path: Path) -> None:
    done = subprocess.run(["bash", str(SCRIPT), *TINY, "--out", str(tmp_path / "r.json")], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "torch.cuda.is_available()" in done.stderr
    assert "passed" not in done.stdout and "skipped" not in done.stdout  # it stopped before the tests
    assert not (tmp_path / "r.json").exists()


# ------------------------------------------------------------------------------------- table and JSON
META = {"gpu": "NVIDIA H200", "torch": "2.13.0+cu128", "cuda": "12.8", "date": "2026-01-02 03:04 UTC", "device": "cuda",
        "dtype": "bfloat16", "shape": "qwen2.5_0.5b", "seq_len": 256, "batch": 1, "lora": "r8, alpha 16, all-linear",
        "optimizer": "AdamW lr 1e-4", "steps": 20, "warmup": 3}
FIGURES = {"qlora": {"peak_mib": 3000.0, "step_s_mean": 0.3},
           "mebp": {"peak_mib": 1000.0, "step_s_mean": 0.2, "num_blocks": 24, "backward_blocks_mean": 24.0},
           "mebp_lcsb": {"peak_mib": 990.5, "step_s_mean": 0.1, "num_blocks": 24, "backward_blocks_mean": 15.0}}


def test_speedups_relative_to_qlora_and_mebp() -> None:
    ratios = report.speedups({name: f["step_s_mean"] for name, f in FIGURES.items()})
    assert ratios["mebp_lcsb"] == pytest.approx({"vs_qlora": 3.0, "vs_mebp": 2.0})
    assert ratios["qlora"] == pytest.approx({"vs_qlora": 1.0, "vs_mebp": 2 / 3})
    assert report.speedups({"mebp_lcsb": 0.1}) == {"mebp_lcsb": {"vs_qlora": None, "vs_mebp": None}}


def test_table_and_json_from_fake_figures(tmp_path: Path) -> None:
    result = report.build_result(META, FIGURES)
    table = report.format_table(result)
    assert "GPU: NVIDIA H200 | torch 2.13.0+cu128 | CUDA 12.8 | 2026-01-02 03:04 UTC" in table
    assert "| arm | what | peak MiB | s/step | speed-up vs qlora | speed-up vs mebp |" in table
    assert "| qlora | peft + bnb nf4 + HF grad ckpt | 3000.0 | 0.3000 | 1.00x | 0.67x | all |" in table
    assert "| mebp_lcsb | mebp + LCSB cyclic k=N/4 | 990.5 | 0.1000 | 3.00x | 2.00x | 15.00 of 24 |" in table
    assert all(f"* {key}:" in table for key in report.SOURCES)
    path = tmp_path / "sub" / "r.json"
    report.write_json(result, path)
    data = json.loads(path.read_text())
    assert data == result and data["arms"]["mebp"]["speedup_vs_qlora"] == pytest.approx(1.5)
    cpu = report.build_result(META, {"mebp": {"peak_mib": None, "step_s_mean": 0.2}})
    assert "| mebp | load_compressed nf4/64, full backprop, chunked loss | - | 0.2000 | - | 1.00x | all |" in (
        report.format_table(cpu))


# ----------------------------------------------------------------------------------- the arms train
def _lora(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def _check_arm_trains(name: str, folder: Path, device: torch.device, dtype: torch.dtype) -> None:
    arm = arms.build_arm(name, folder, device, dtype)
    try:
        ids = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(0)).to(device)
        before = _lora(arm.model)
        first = arms.train_step(arm, ids)
        assert math.isfinite(first.loss) and first.seconds > 0
        after = _lora(arm.model)
        lora_b = {n for n in before if "lora_B" in n}  # zero-initialised: moves only with a gradient
        assert len(lora_b) == 2 * 7 and all(not torch.equal(before[n], after[n]) for n in lora_b)
        assert all(p.dtype == torch.float32 for p in after.values())
        # qlora: no compressed blocks; mebp: both blocks; mebp_lcsb's step 0: cyclic group (0,), all_reached: (0, 1)
        assert first.backward_blocks == (None if name == "qlora" else (0, 1))
        if name == "mebp_lcsb":
            second = arms.train_step(arm, ids)
            assert arm.controller.selection == (1,)
            assert second.backward_blocks == (1,) and math.isfinite(second.loss)  # block 0: no backward at all
    finally:
        if arm.controller is not None:
            arm.controller.release()


@pytest.mark.parametrize("name", arms.ARMS)
def test_arm_trains_on_cpu(name: str, tiny_folder: Path) -> None:
    _check_arm_trains(name, tiny_folder, torch.device("cpu"), torch.float32)


def test_main_on_cpu_writes_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    assert cli.main([*TINY, "--device", "cpu", "--out", str(out), "--model-dir", str(tmp_path / "init")]) == 0
    data = json.loads(out.read_text())
    assert list(data["arms"]) == list(arms.ARMS) and data["meta"]["dtype"] == "float32"
    for fig in data["arms"].values():
        assert fig["peak_mib"] is None and len(fig["step_s_all"]) == 2 and math.isfinite(fig["loss_last"])
    assert data["arms"]["mebp"]["backward_blocks_mean"] == 2.0
    assert data["arms"]["mebp_lcsb"]["backward_blocks_mean"] == 1.5  # steps 1 and 2: (1,), then (0, 1)
    assert data["arms"]["mebp"]["mebp"]
    for fig in data["arms"].values():  # the speed-ups are the ratios of the measured mean step times (rounded)
        assert fig["step_s_mean"] == pytest.approx(sum(fig["step_s_all"]) / 2, rel=1e-3)
        assert fig["speedup_vs_mebp"] == pytest.approx(data["arms"]["mebp"]["step_s_mean"] / fig["step_s_mean"], rel=1e-3)
        assert fig["speedup_vs_qlora"] == pytest.approx(data["arms"]["qlora"]["step_s_mean"] / fig["step_s_mean"], rel=1e-3)
    assert data["arms"]["mebp"]["speedup_vs_mebp"] == pytest.approx(1.0)
    assert "| mebp_lcsb |" in capsys.readouterr().out


# ------------------------------------------------------------------------- on CUDA (gpu_check.sh runs these)
@needs_cuda
@pytest.mark.parametrize("name", arms.ARMS)
def test_on_cuda_arm_trains_in_bf16(name: str, tiny_folder: Path) -> None:
    _check_arm_trains(name, tiny_folder, torch.device("cuda"), torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_nf4_codes_made_on_cpu_decode_alike(dtype: torch.dtype) -> None:
    from lcsb_lightning.mebp._internal.formats import get_format
    from lcsb_lightning.mebp._internal.stored import Packed

    nf4 = get_format("nf4")
    packed = nf4.quantize(torch.randn(96, 128, generator=torch.Generator().manual_seed(0)), 64)  # as load_compressed
    on_cpu = nf4.dequantize(packed, 64, torch.float32)
    on_cuda = nf4.dequantize(Packed(packed.codes.cuda(), packed.scales.cuda()), 64, dtype)
    assert on_cuda.dtype == dtype and on_cuda.device.type == "cuda"
    torch.testing.assert_close(on_cuda.float().cpu(), on_cpu, rtol=1e-2 if dtype == torch.bfloat16 else 0, atol=1e-6)


@needs_cuda
def test_on_cuda_compressed_linear_and_chunked_loss_match_the_dequantized_weight() -> None:
    from lcsb_lightning.mebp import CompressedLinear, chunked_lm_loss
    from lcsb_lightning.mebp._internal.formats import get_format

    torch.manual_seed(0)
    layer = CompressedLinear.from_linear(torch.nn.Linear(128, 320), "nf4", 64).cuda()
    weight = get_format("nf4").dequantize(layer.packed(), 64, torch.float32)
    x = torch.randn(2, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().square().sum().backward()
    ref_x = x.detach().float().requires_grad_()
    ref = F.linear(ref_x, weight, layer.bias.float())
    ref.square().sum().backward()
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x.grad.float(), ref_x.grad, rtol=3e-2, atol=3e-2)
    head = CompressedLinear.from_linear(torch.nn.Linear(128, 320, bias=False), "nf4", 64).cuda()
    labels = torch.randint(0, 320, (1, 16), device="cuda")
    hidden = torch.randn(1, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    loss = chunked_lm_loss(hidden, head, labels, chunk_size=5)
    loss.backward()
    ref_h = hidden.detach().float().requires_grad_()
    logits = F.linear(ref_h, get_format("nf4").dequantize(head.packed(), 64, torch.float32))
    ref_loss = F.cross_entropy(logits[:, :-1].reshape(-1, 320), labels[:, 1:].reshape(-1))
    ref_loss.backward()
    torch.testing.assert_close(loss.float(), ref_loss, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(hidden.grad.float(), ref_h.grad, rtol=2e-2, atol=1e-3)


@needs_cuda
def test_on_cuda_main_tiny_measures_memory(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert cli.main([*TINY, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["gpu"] == torch.cuda.get_device_name() and data["meta"]["dtype"] == "bfloat16"
    for fig in data["arms"].values():
        assert fig["peak_mib"] > 0 and fig["peak_mib"] >= fig["resident_mib"] > 0
        assert fig["warmup_peak_mib"] > 0 and fig["step_s_mean"] > 0
