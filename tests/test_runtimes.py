"""Container runtimes as data: one lookup of the binary, one argv builder reading records."""

from __future__ import annotations

import pytest

from hpcai.core.errors import UserError
from hpcai.launcher.container.containers import (
    RUNTIMES, Bind, ContainerSpec, Runtime, find_binary, get_runtime, wrap)


def test_check_runtime(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "")
    with pytest.raises(UserError) as err:
        find_binary(get_runtime("charliecloud"), None)
    assert err.value.message == "container runtime charliecloud: ch-run not found on PATH"
    assert "apt-get install charliecloud-runtime" in err.value.hint
    with pytest.raises(UserError) as err:
        find_binary(get_runtime("singularity"), None)
    assert err.value.message == ("container runtime singularity: singularity or apptainer "
                                 "not found on PATH")
    assert "Apptainer" in err.value.hint
    with pytest.raises(UserError, match="unknown container runtime 'docker'"):
        get_runtime("docker")
    fake = tmp_path / "apptainer"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_binary(get_runtime("singularity"), None) == str(fake)


def test_a_new_runtime_is_a_record_not_a_branch(monkeypatch):
    """wrap() reads the record's spellings: a runtime added as data gets its own argv."""
    podman = Runtime("podman-hpc", ("podman-hpc",), "install podman-hpc", exec_args=("run",),
                     join_args=(), bind_flag="-v", read_only_suffix=":ro", env_flag="-e",
                     explicit_env=("LD_LIBRARY_PATH",), workdir_flag="-w",
                     before_command=())
    monkeypatch.setitem(RUNTIMES, "podman-hpc", podman)
    spec = ContainerSpec(runtime="podman-hpc", binary="/usr/bin/podman-hpc", image="img",
                         binds=(Bind("/h", "/c", read_only=True), Bind("/o", "/o", False)),
                         workdir="/w", env=(("LD_LIBRARY_PATH", "/c/lib"), ("X", "1")))
    assert wrap(spec, ("python3", "-V")) == [
        "/usr/bin/podman-hpc", "run", "-v", "/h:/c:ro", "-v", "/o:/o", "-e",
        "LD_LIBRARY_PATH=/c/lib", "-w", "/w", "img", "python3", "-V"]
