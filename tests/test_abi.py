"""The MPI ABI table (hpcai.launcher.mpi.abi): its records are consistent, the lookups read
them, and a flavour or family added to the table is picked up by detection, host-MPI
discovery, collection and planning without other code changes."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from hpcai.core.errors import UserError
from hpcai.launcher.mpi import abi, flavours, hostmpi
from hpcai.launcher.container import hostlibs, preflight
from hpcai.launcher.mpi import pmi
from hpcai.launcher.mpi.abi import CompatLink, Family, Flavour
from hpcai.launcher.mpi.flavours import MpiInstall
from hpcai.launcher.planning.facts import Facts
from hpcai.launcher.planning.options import Options
from hpcai.launcher.planning.plan import build_plan, mpi_library_env
from hpcai.launcher.node.topology import synthetic


# --- the table is consistent ---------------------------------------------------------------

def test_every_record_points_at_a_family_of_the_table():
    for flavour in abi.FLAVOURS.values():
        assert abi.FAMILIES[flavour.family] is flavour.abi
    for impl in abi.IMPLEMENTATIONS:
        assert abi.FAMILIES[impl.family.name] is impl.family
    for family in abi.FAMILIES.values():
        for link in family.compat:
            assert family.owns(link.name) and family.owns(link.target)
        assert family.sonames or family.soname_glob


def test_sonames_belong_to_one_family_each():
    names = [n for f in abi.FAMILIES.values() for n in (*f.sonames, f.soname_glob) if n]
    for name in names:
        assert sum(f.owns(name) for f in abi.FAMILIES.values()) == 1, name


def test_multiarch_is_this_machines():
    expected = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    assert abi.MULTIARCH == expected
    assert abi.SYSTEM_LIBDIRS[:2] == (f"/usr/lib/{expected}", f"/lib/{expected}")
    assert preflight.IMAGE_LIB_DIRS[0] == f"/usr/lib/{expected}"


def test_lookups():
    assert abi.family_of_soname("libmpi.so.40").name == "openmpi"
    assert abi.family_of_soname("libmpich.so.12").name == "mpich"
    assert abi.family_of_soname("libmpi_abi.so.1").name == "mpiabi"
    assert abi.family_of_soname("libmpi.so") is None
    assert abi.family_of_soname("libfabric.so.1") is None
    assert abi.family_for_pmi("pmix").name == "openmpi"       # the first that uses it
    assert abi.family_for_pmi("pmi2").name == "mpich"
    assert abi.family_for_pmi("none") is None
    assert abi.family_of_launcher("orterun").name == "openmpi"
    assert abi.family_of_launcher("mpiexec.hydra").name == "mpich"
    assert abi.family_of_launcher("mpirun") is None
    names = {"libz.so.1", "libmpi_abi.so.1", "libmpich.so.12", "libmpi.so.40"}
    assert abi.libmpi_names(names) == ["libmpi.so.40", "libmpich.so.12", "libmpi_abi.so.1"]
    assert abi.libmpi_names(names, prefer="mpich") == [
        "libmpich.so.12", "libmpi.so.40", "libmpi_abi.so.1"]
    assert abi.implementation("intel").bundled_switch == "I_MPI_OFI_LIBRARY_INTERNAL"
    assert abi.implementation("nope") is None


def test_check_pmi_names_the_flavours_from_the_table():
    with pytest.raises(UserError) as err:
        pmi.check("pmi2", "MPI plugin types are...\n\tnone\n")
    assert err.value.hint.startswith("MPICH and Intel MPI under srun needs --mpi=pmi2")
    with pytest.raises(UserError) as err:
        pmi.check("cray_shasta", "MPI plugin types are...\n\tnone\n")
    assert err.value.hint.startswith("this MPI under srun needs --mpi=cray_shasta")


def _facts(mpi: MpiInstall, uid: int = 1000) -> Facts:
    return Facts(env={"PATH": "/usr/bin"}, topology=synthetic("pack:1 numa:1 core:2"),
                 hostname="node001", self_argv=("hpcai-launch",),
                 command_path="/usr/bin/python3", uid=uid, mpi=mpi, cache_dir="/c")


def test_root_flags_come_from_the_record():
    ompi = MpiInstall(abi.OPENMPI, "/usr/bin/mpirun.openmpi", "4.1.4", None, "test")
    plan = build_plan(Options(command=("true",), ranks_per_node=2), _facts(ompi, uid=0))
    assert plan.argv[5:7] == ("--allow-run-as-root", "--map-by")
    assert "running as root: Open MPI needs --allow-run-as-root" in plan.notes
    mpich = MpiInstall(abi.MPICH, "/usr/bin/mpiexec.mpich", "4.0.2", None, "test")
    plan = build_plan(Options(command=("true",), ranks_per_node=2), _facts(mpich, uid=0))
    assert "--allow-run-as-root" not in plan.argv and not plan.notes


# --- a record added to the table is enough -------------------------------------------------

TOY_FAMILY = Family(
    name="toy", title="Toy", sonames=("libtoympi.so.3", "libtoy.so.3"), mpi4py_abi="toyabi",
    pmi="pmi2", compat=(CompatLink("libtoympi.so.3", "libtoy.so.3"),),
    launcher_words=("toyrun",), unmarked_name="toympi")


def _toy_binding(p) -> list[str]:
    return ["--toy-cpus", ";".join(s.cpulist for s in p.slots)]


TOY = Flavour(
    name="toympi", title="Toy MPI", abi=TOY_FAMILY, launchers=("toyrun", "mpiexec"),
    version_pattern=r"Toy MPI", export_env=("--env", "{key}={value}"), hosts_style="slots",
    binding_args=_toy_binding, binding_env=lambda p: {"TOY_PIN": "1"},
    root_flags=("--i-am-root",), root_var="TOY_ROOT", detect_first=True)


@pytest.fixture
def toy(monkeypatch, tmp_path) -> Path:
    """The toy flavour and family in the table; an install with a launcher that says
    'Toy MPI 3.1 (HYDRA)' (so MPICH's pattern matches it too) and lib/ holding only the
    compat target libtoy.so.3."""
    monkeypatch.setitem(abi.FAMILIES, TOY_FAMILY.name, TOY_FAMILY)
    monkeypatch.setitem(abi.FLAVOURS, TOY.name, TOY)
    root = tmp_path / "toy"
    (root / "bin").mkdir(parents=True)
    (root / "lib").mkdir()
    launcher = root / "bin" / "toyrun"
    launcher.write_text("#!/bin/sh\necho 'Toy MPI 3.1 (HYDRA process manager)'\n")
    launcher.chmod(0o755)
    return root


def test_added_flavour_is_detected_and_located(toy):
    assert flavours.get("toympi") is TOY
    assert flavours.classify_version_text("Toy MPI 3.1 (HYDRA)") is TOY
    assert flavours.find_launcher(TOY, {"TOY_ROOT": str(toy), "PATH": ""}) == str(
        toy / "bin" / "toyrun")
    (toy / "lib" / "libtoy.so.3").write_bytes(b"")
    found = flavours.resolve("auto", str(toy / "bin" / "toyrun"), {"PATH": ""})
    assert (found.flavour, found.version, found.libdir) == (TOY, "3.1", str(toy / "lib"))
    with pytest.raises(UserError, match="--mpi openmpi asked for, but .* is Toy MPI"):
        flavours.resolve("openmpi", str(toy / "bin" / "toyrun"), {"PATH": ""})


def test_added_flavour_plans_with_its_own_spellings(toy):
    (toy / "lib" / "libtoy.so.3").write_bytes(b"")
    mpi = flavours.locate(TOY, str(toy / "bin" / "toyrun"), {"PATH": ""})
    plan = build_plan(Options(command=("true",), ranks_per_node=2), _facts(mpi, uid=0))
    argv = list(plan.argv)
    assert argv[:6] == [str(toy / "bin" / "toyrun"), "-n", "2", "--host", "node001:2",
                        "--i-am-root"]
    assert argv[6:8] == ["--toy-cpus", "0;1"]
    assert "--env" in argv and "TOY_PIN=1" in argv and "MPI4PY_MPIABI=toyabi" in argv
    assert "running as root: Toy MPI needs --i-am-root" in plan.notes
    env, links, notes = mpi_library_env(mpi, {}, "/c")
    assert links == (("/c/abi/toympi/libtoympi.so.3", f"{toy}/lib/libtoy.so.3"),)
    assert env == {"MPI4PY_MPIABI": "toyabi", "LD_LIBRARY_PATH": "/c/abi/toympi"}
    assert notes == [f"{toy}/lib has libtoy.so.3 but no libtoympi.so.3 (Debian layout): a "
                     "compat link makes Toy-ABI programs load it"]


@pytest.mark.skipif(not shutil.which("gcc"), reason="needs gcc")
def test_added_family_is_found_identified_and_collected(toy):
    lib = toy / "lib" / "libtoy.so.3"
    src = toy / "toy.c"
    src.write_text("int toy_x;\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src),
                    "-Wl,-soname,libtoy.so.3"], check=True, capture_output=True)
    host = hostmpi.find_host_mpi({}, str(toy / "bin" / "toyrun"), ldconfig_output="")
    assert (host.family, host.name, host.soname, host.root) == (
        "toy", "toympi", "libtoy.so.3", str(toy))
    assert hostmpi.find_host_mpi({"MPI_HOME": str(toy)}, ldconfig_output="",
                                 require="openmpi") is None
    libs = hostlibs.collect(host, [], set(), None)
    assert [(x.name, x.role) for x in libs] == [("libtoy.so.3", "mpi"),
                                                ("libtoympi.so.3", "mpi")]
    assert hostlibs.binding_env("/mnt", libs)["MPI4PY_MPIABI"] == "toyabi"
    assert pmi.choose(None, None, abi.FAMILIES[host.family].pmi) == "pmi2"


def test_without_the_records_nothing_knows_the_toy():
    """Negative control: the fixture's records are what the tests above depend on."""
    assert "toympi" not in abi.FLAVOURS and "toy" not in abi.FAMILIES
    assert flavours.classify_version_text("Toy MPI 3.1") is None
    assert abi.family_of_soname("libtoy.so.3") is None
    assert abi.family_of_launcher("toyrun") is None


def test_launcher_version_runs_once_per_identity(tmp_path, monkeypatch):
    """``resolve`` keeps ``LAUNCHER --version``'s text in hpcai's cache (written when
    hpcai-launch launches: ``keep_versions``): a second launch with the same launcher reads
    it (the launcher counts its runs). The controls: another ``OPAL_PREFIX`` and a rewritten
    launcher file each run it again, and the rewritten one's new version is the one
    reported."""
    count = tmp_path / "runs"
    launcher = tmp_path / "bin" / "mpirun"
    launcher.parent.mkdir()

    def write(version: str) -> None:
        launcher.write_text(f"#!/bin/sh\necho run >> {count}\necho 'mpirun (Open MPI) {version}'\n")
        launcher.chmod(0o755)

    def runs() -> int:
        return len(count.read_text().splitlines()) if count.exists() else 0

    write("4.1.4")
    env = {"PATH": "", "HPCAI_CACHE": str(tmp_path / "cache")}
    monkeypatch.delenv("OPAL_PREFIX", raising=False)
    first = flavours.resolve("auto", str(launcher), env)
    flavours.keep_versions()      # hpcai-launch keeps them only when it launches
    again = flavours.resolve("auto", str(launcher), env)
    assert (first.flavour, first.version, again.version, runs()) == (flavours.OPENMPI, "4.1.4",
                                                                    "4.1.4", 1)
    monkeypatch.setenv("OPAL_PREFIX", str(tmp_path))
    flavours.resolve("auto", str(launcher), env)
    assert runs() == 2
    write("4.1.10")   # another size: the file system may keep the same mtime
    assert flavours.resolve("auto", str(launcher), env).version == "4.1.10" and runs() == 3
    flavours.keep_versions()
    assert flavours.resolve("auto", str(launcher), env).version == "4.1.10" and runs() == 3
