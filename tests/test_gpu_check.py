"""The GPU suite (``make gpu-check``): honest on a CPU machine, and its checks' code runs.

On CPU the suite must print one line saying there is no CUDA device and exit 0. Its
chapter checks are then run here on gloo ranks (backend expected: gloo), which proves
the code of each check runs and compares, not that GPUs pass it: that needs a GPU.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dtlib.bench import gpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cpu_machine_gets_one_line_and_exit_0():
    out = subprocess.run([sys.executable, "-m", "dtlib.bench", "gpu"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], out.stdout


def test_peaks_by_device_name():
    assert gpu.peak_tflops("NVIDIA H100 PCIe") == (756.0, 756.0, 378.0)
    assert gpu.peak_tflops("NVIDIA H200")[0] == 989.4
    assert gpu.peak_tflops("NVIDIA A100-SXM4-80GB")[2] == 156.0
    assert gpu.peak_tflops("Some Future GPU") is None


def test_exit_status_fails_on_a_failed_check():
    assert gpu.exit_status([{"status": "PASS"}, {"status": "SKIP"}]) == 0
    assert gpu.exit_status([{"status": "PASS"}, {"status": "FAIL"}]) == 1


@pytest.mark.parametrize("check", ["ch0", "ch2", "ch3", "ch4", "ch6", "ch7",
                                   "ch14", "ch15", "capstone"])
def test_each_chapter_check_runs_and_passes_on_gloo(check, monkeypatch):
    monkeypatch.setattr(gpu, "EXPECT_BACKEND", "gloo")
    ok, detail = gpu.RUNNERS[check](2, 200.0)
    assert ok, detail
