"""The ranks' device is a :class:`grader.device.Device` from the command line to the rank:
read once where it comes in (``--backend``, a head's ``run``, a rank's environment), and a
value the grader does not know is one line, never a rank on a device nobody chose."""

from __future__ import annotations

from pathlib import Path

import pytest

from grader import device, sandbox
from grader.device import Device
from grader.launch.job import job_settings
from grader.launch.plan import SandboxPlan
from grader.sandbox import view


@pytest.mark.parametrize("text", ["tpu", "CUDA", "", None, ["cuda"]])
def test_an_unknown_device_is_one_line_naming_where_it_came_from(text: object) -> None:
    with pytest.raises(ValueError, match=r"^\$X: unknown device .* \(choose cpu, cuda\)$"):
        device.parse(text, "$X")


def test_a_device_is_read_as_its_member() -> None:
    assert device.parse("cuda", "here") is Device.CUDA
    assert device.parse(Device.CPU.value, "here") is Device.CPU


def test_a_rank_refuses_a_device_it_was_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(device.ENV_VAR, raising=False)
    assert device.of_rank() is Device.CPU
    monkeypatch.setenv(device.ENV_VAR, "cuda")
    assert device.of_rank() is Device.CUDA
    monkeypatch.setenv(device.ENV_VAR, "cuda:1")
    with pytest.raises(ValueError, match="GRADER_DEVICE: unknown device 'cuda:1'"):
        device.of_rank()


def test_a_chosen_device_is_kept() -> None:
    assert device.detect(Device.CUDA) is Device.CUDA
    assert device.detect(Device.CPU) is Device.CPU


def test_only_a_rank_on_a_gpu_may_open_the_gpus_files() -> None:
    on_cpu = {rule.path for rule in view.allowed([], Device.CPU)}
    on_gpu = {rule.path for rule in view.allowed([], Device.CUDA)}
    assert "/dev/nvidiactl" not in on_cpu and "/dev/nvidiactl" in on_gpu


def test_the_sandbox_plan_keeps_level_and_device_typed(tmp_path: Path) -> None:
    """What the grader writes for a job's wrappers is read back as the same members."""
    settings = job_settings(tmp_path, sandbox.Level.NONE, Device.CUDA)
    assert settings.level is sandbox.Level.NONE and settings.device is Device.CUDA
    plan = SandboxPlan(settings.level, "s", "i", [], [], "", 1, [], device=settings.device)
    plan.write(tmp_path)
    read = SandboxPlan.read(tmp_path)
    assert read == plan and read.level is sandbox.Level.NONE and read.device is Device.CUDA
