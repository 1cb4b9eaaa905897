"""kfac-jax's users on kfacx: FermiNet's and DeepQMC's tests, kfac-jax's own suite, an energy.

``kfacx.kfac_jax`` serves kfac-jax 0.0.8's API on kfacx, so that a kfac-jax user moves
over by changing ``import kfac_jax`` to ``import kfacx.kfac_jax as kfac_jax``. This
script checks that claim on real clients, each run under two *engines*:

- ``kfac-jax`` (the peer, the baseline): jax 0.9.0 + kfac-jax 0.0.8 from PyPI, the
  client's code untouched;
- ``kfacx``: the newest jax (``--kfacx-jax`` pins another, e.g. 0.10.2, in a venv of its
  own; jax >= 0.11 needs Python 3.12, ``--kfacx-python``) + kfacx installed editable
  from this repository (no kfac-jax), the client's code copied with only its
  ``kfac_jax`` import lines rewritten (``import kfac_jax`` ->
  ``import kfacx.kfac_jax as kfac_jax``, ``from kfac_jax[.x] import`` ->
  ``from kfacx.kfac_jax[.x] import``, and ``_target_: kfac_jax.X`` in YAML configs).

Parts (``--part``, several allowed, comma-separated or repeated):

``setup``           the virtualenvs (made with uv under ``--workdir``/venvs, reused after);
``names``           the kfac_jax names FermiNet, DeepQMC and kfac-jax's tests use, and
                    whether each resolves under the chosen engines;
``ferminet-tests``  FermiNet's train_test.py (its K-FAC cases by default), networks_test.py
                    and psiformer_test.py on 1 and 2 (virtual CPU) devices;
``kfac-jax-tests``  kfac-jax v0.0.8's own tests/, per file, with the first line of each
                    failure's exception;
``energy``          FermiNet trains H2 (and LiH) with K-FAC, same seed and config for
                    each engine: mean energy over the last iterations with its standard
                    error, median seconds per iteration, kfacx/kfac-jax time ratio;
``deepqmc``         DeepQMC 1.3.0 (Python 3.12, jax < 0.9, kfac-jax 0.0.8's API): its tests/
                    from the 1.3.0 tag, test_app.py's K-FAC training run of H2 included.
                    1.2.0 installs and imports on Python 3.11 but predates kfac-jax
                    0.0.7's API and fails on jax >= 0.6; the part says so.

An engine whose import fails is reported as such (the row says ``import failed`` with
the exception's last line), never a crash. Logs, JUnit XML and JSON results go under
``--workdir`` (default /work/clients): ``logs/``, ``junit/``, ``results/<part>.json``.

Examples::

    python benchmarks/clients.py --part setup
    python benchmarks/clients.py --part ferminet-tests --engine kfac-jax --devices 1,2
    python benchmarks/clients.py --part kfac-jax-tests --engine both
    python benchmarks/clients.py --part energy --systems H2,LiH --iterations 500
    python benchmarks/clients.py --part names --engine kfacx

Only the standard library is imported at the top: the script also runs itself inside
the virtualenvs (``--_worker``) for the parts that need jax.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENGINES = ("kfac-jax", "kfacx")
PARTS = ("setup", "names", "ferminet-tests", "kfac-jax-tests", "energy", "deepqmc")

DEFAULT_FERMINET = "/work/.mirror/google-deepmind+ferminet/repo"
DEFAULT_KFAC_JAX = "/work/.mirror/google-deepmind+kfac-jax/repo"
DEFAULT_DEEPQMC = "/work/.mirror/deepqmc+deepqmc/repo"
URLS = {
    "ferminet": "https://github.com/google-deepmind/ferminet",
    "kfac-jax": "https://github.com/google-deepmind/kfac-jax",
    "deepqmc": "https://github.com/deepqmc/deepqmc",
}

PEER_PINS = ["jax==0.9.0", "jaxlib==0.9.0", "kfac-jax==0.0.8"]
# kfac-jax's tests need haiku and distrax (tests/models.py); pytest-xdist for -n.
TEST_DEPS = ["pytest", "pytest-xdist", "dm-haiku", "distrax"]
# DeepQMC 1.3.0's requirements (its pyproject) less kfac-jax, jax and jaxlib, plus its
# test requirements. hydra-core is pinned: 1.3.7 and later refuse the '{'-style logging
# formatter of DeepQMC's hydra config ("Logging format style '{' cannot be selected by
# declarative configuration"), so the `deepqmc` command fails before it starts.
DEEPQMC_DEPS = [
    "dm-haiku",
    "folx",
    "h5py",
    "hydra-core==1.3.2",
    "jax-dataclasses",
    "scipy",
    "optax",
    "pyscf",
    "tensorboardX",
    "pyyaml",
    "tqdm",
    "uncertainties",
    "chex<1.0.0",
    "jaxtyping",
    "pytest",
    "pytest-regressions",
]

# FermiNet train_test.py cases that do not use K-FAC (optimizer adam/lamb/none); the
# QmcTest.test_training_step cases are classified from _config_params itself.
FERMINET_NON_KFAC = ("QmcTest::test_inference_step", "QmcPyscfMolTest::test_training_step_pyscf0")
# --train-tests quick: one K-FAC case of each kind (real/complex, states, folx, H atom,
# spin penalty, pyscf molecule, pseudopotential, SchNet features).
FERMINET_QUICK = (
    "QmcTest::test_training_step0",
    "QmcTest::test_training_step1",
    "QmcTest::test_training_step2",
    "QmcTest::test_training_step18",
    "QmcTest::test_training_step25",
    "QmcTest::test_s2_energy0",
    "QmcPyscfMolTest::test_training_step_pyscf1",
    "QmcPyscfMolTest::test_pseudopotential_step0",
    "QmcPyscfMolTest::test_schnet_training_step0",
)


# ----------------------------------------------------------------------------- utilities


def log(msg: str) -> None:
    print(msg, flush=True)


def run(cmd, *, log_path: Path | None = None, cwd=None, env=None, timeout=None, check=False):
    """Runs cmd; stdout+stderr to log_path (or captured). Returns (rc, seconds, output)."""
    t0 = time.perf_counter()
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(log_path, "w")) if log_path else subprocess.PIPE
        try:
            proc = subprocess.run(
                [str(c) for c in cmd],
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout,
            )
            rc, text = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as e:
            rc, text = 124, e.stdout if isinstance(e.stdout, str) else None
    dt = time.perf_counter() - t0
    if log_path is not None:
        text = log_path.read_text(errors="replace")
    text = text or ""
    if check and rc != 0:
        raise SystemExit(f"command failed ({rc}): {' '.join(map(str, cmd))}\n{text[-3000:]}")
    return rc, dt, text


def last_error_line(text: str) -> str:
    """The exception line of a traceback (the last line that looks like 'Name: msg')."""
    lines = [re.sub(r"^E\s+", "", ln.strip()) for ln in text.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b", ln) or re.match(
            r"^E\s+\w+(Error|Exception)", ln
        ):
            return ln[:300]
    return (lines[-1] if lines else "")[:300]


def table(rows: list[list], header: list[str]) -> str:
    cols = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cols) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    out += [fmt.format(*r) for r in cols[1:]]
    return "\n".join(out)


def save_result(workdir: Path, part: str, key: str, value) -> None:
    path = workdir / "results" / f"{part}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = value
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


def base_env(venv: Path, devices: int = 1) -> dict:
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "XLA_FLAGS")
    }
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        env["FERMINET_CHEX_N_CPU_DEVICES"] = str(devices)
    return env


# ----------------------------------------------------------------------------- sources


def checkout(workdir: Path, name: str, source: str, ref: str | None) -> Path:
    """A work tree of `source` (a work tree, a bare git dir or a URL) under workdir/src."""
    src = Path(source)
    if src.is_dir() and not (src / "HEAD").exists() and not ref:
        return src  # a work tree (or a plain copy) given as is
    dest = workdir / "src" / (name + (f"-{ref}" if ref else ""))
    if not dest.exists():
        if not src.exists() and "://" not in source:
            raise SystemExit(f"{name}: no repository at {source}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        run(["git", "clone", "-q", source, dest], check=True)
        if ref:
            run(["git", "-C", dest, "checkout", "-q", ref], check=True)
    return dest


IMPORT_RULES = [
    # import kfac_jax  /  import kfac_jax as k  /  import kfac_jax.utils as u
    (
        re.compile(r"^(\s*)import kfac_jax(\s*(#.*)?)$", re.M),
        r"\1import kfacx.kfac_jax as kfac_jax\2",
    ),
    (
        re.compile(r"^(\s*)import kfac_jax(\.[\w.]+)? as (\w+)", re.M),
        r"\1import kfacx.kfac_jax\2 as \3",
    ),
    # from kfac_jax import x  /  from kfac_jax.utils import x
    (
        re.compile(r"^(\s*)from kfac_jax(\.[\w.]+)? import ", re.M),
        r"\1from kfacx.kfac_jax\2 import ",
    ),
]
YAML_RULE = (re.compile(r"(_target_:\s*['\"]?)kfac_jax\."), r"\1kfacx.kfac_jax.")


def rewrite_tree(root: Path) -> list[str]:
    """Rewrites kfac_jax imports (and hydra _target_ strings) in place; returns what changed."""
    changed = []
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".py", ".yaml", ".yml") or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        new = text
        if path.suffix == ".py":
            for pat, rep in IMPORT_RULES:
                new = pat.sub(rep, new)
        else:
            new = YAML_RULE[0].sub(YAML_RULE[1], new)
        if new != text:
            n = sum(a != b for a, b in zip(text.splitlines(), new.splitlines(), strict=False))
            changed.append(f"{path.relative_to(root)} ({n} lines)")
            path.write_text(new)
    left = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if re.search(r"^\s*(import|from) kfac_jax\b", p.read_text(errors="replace"), re.M)
    ]
    if left:
        changed.append(f"NOT rewritten (unusual import form): {left}")
    return changed


def engine_copy(workdir: Path, name: str, src: Path, engine: str, subdirs=None) -> Path:
    """A fresh copy of src (or of its subdirs) for an engine; rewritten for kfacx."""
    dest = workdir / "trees" / f"{name}-{engine}"
    if dest.exists():
        shutil.rmtree(dest)
    ignore = shutil.ignore_patterns(".git", "__pycache__", "*.pyc")
    if subdirs:
        for sub in subdirs:
            shutil.copytree(src / sub, dest / sub, ignore=ignore)
    else:
        shutil.copytree(src, dest, ignore=ignore)
    if engine == "kfacx":
        changed = rewrite_tree(dest)
        (dest / "REWRITTEN.txt").write_text("\n".join(changed) + "\n")
    return dest


# ----------------------------------------------------------------------------- venvs


def uv(workdir: Path) -> list[str]:
    tools = workdir / "venvs" / "tools"
    exe = tools / "bin" / "uv"
    if not exe.exists():
        run([sys.executable, "-m", "venv", tools], check=True)
        run([tools / "bin" / "pip", "install", "-q", "uv"], check=True)
    return [str(exe)]


def find_python(request: str) -> str:
    """An interpreter for a version request ("3.12") or a path; '' when none is found."""
    if os.path.sep in request:
        return request if os.path.exists(request) else ""
    for cand in [f"python{request}"] + sorted(
        glob.glob(os.path.expanduser(f"~/.pyenv/versions/{request}*/bin/python{request}")),
        reverse=True,
    ):
        exe = shutil.which(cand) or (cand if os.path.exists(cand) else None)
        if exe and subprocess.run([exe, "-c", "import sys"], capture_output=True).returncode == 0:
            return exe
    return ""


def ferminet_requirements(ferminet: Path) -> list[str]:
    """FermiNet's setup.py REQUIRED_PACKAGES, with the git URLs replaced by PyPI names
    and kfac_jax, jax and jaxlib dropped (each engine brings its own)."""
    tree = ast.parse((ferminet / "setup.py").read_text())
    reqs = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", "") == "REQUIRED_PACKAGES" for t in node.targets
        ):
            reqs = [ast.literal_eval(e) for e in node.value.elts]
    out = []
    for r in reqs:
        name = re.split(r"[\s@<>=!~;\[]", r, maxsplit=1)[0].strip()
        if name.replace("_", "-").lower() in ("kfac-jax", "jax", "jaxlib"):
            continue
        out.append(name if "@" in r else r)
    return out


def ensure_venv(
    args,
    name: str,
    python_request: str,
    packages: list[str],
    editable: Path | None = None,
    no_deps: list[str] = (),
) -> tuple[Path | None, str]:
    """Creates (or reuses) workdir/venvs/<name>. Returns (venv, note)."""
    workdir = args.workdir
    venv = workdir / "venvs" / name
    spec = json.dumps([python_request, packages, str(editable), list(no_deps)])
    marker = venv / ".clients-spec"
    if venv.exists() and marker.exists() and marker.read_text() == spec and not args.rebuild:
        return venv, "reused"
    python = find_python(python_request)
    note = ""
    if not python:
        python = sys.executable
        note = f"no python {python_request} here: using {python}"
    if venv.exists():
        shutil.rmtree(venv)
    uvx = uv(workdir)
    logp = workdir / "logs" / f"venv-{name}.log"
    env = dict(os.environ, UV_PYTHON_DOWNLOADS="never")
    rc, _, out = run(uvx + ["venv", "-q", "-p", python, venv], log_path=logp, env=env)
    if rc:
        return None, f"uv venv failed: {last_error_line(out)}"
    cmd = uvx + ["pip", "install", "-p", venv / "bin" / "python"] + packages
    if editable is not None:
        cmd += ["-e", editable]
    rc, dt, out = run(cmd, log_path=logp, env=env)
    if rc == 0 and no_deps:
        rc, _, out = run(
            uvx + ["pip", "install", "--no-deps", "-p", venv / "bin" / "python"] + list(no_deps),
            log_path=workdir / "logs" / f"venv-{name}-nodeps.log",
            env=env,
        )
    if rc:
        return None, f"install failed: {last_error_line(out)} (log {logp})"
    marker.write_text(spec)
    return venv, (note + f" built in {dt:.0f}s").strip()


def versions(venv: Path, mods=("jax", "jaxlib", "kfac_jax", "kfacx")) -> str:
    code = (
        "import importlib.metadata as m, sys\n"
        f"for n in {list(mods)!r}:\n"
        "  d = {'kfac_jax': 'kfac-jax'}.get(n, n)\n"
        "  try: print(n, m.version(d))\n"
        "  except Exception: pass\n"
        "print('python', sys.version.split()[0])\n"
    )
    rc, _, out = run([venv / "bin" / "python", "-c", code], cwd=venv)  # not the repo's egg-info
    return ", ".join(out.strip().splitlines()) if rc == 0 else "?"


def engine_venv(args, engine: str) -> tuple[Path | None, str]:
    ferminet = ferminet_source(args)
    reqs = ferminet_requirements(ferminet) + TEST_DEPS
    if engine == "kfac-jax":
        return ensure_venv(args, "peer", args.peer_python, PEER_PINS + reqs)
    jax_spec = (
        ["jax", "jaxlib"]
        if args.kfacx_jax == "newest"
        else [f"jax=={args.kfacx_jax}", f"jaxlib=={args.kfacx_jax}"]
    )
    return ensure_venv(
        args, kfacx_venv_name("kfacx", args), args.kfacx_python, jax_spec + reqs, editable=REPO
    )


def engine_tag(args, engine: str) -> str:
    """The engine's name in tables, labels and file names: kfacx[jax0.10.2] when pinned."""
    return (
        engine if engine != "kfacx" or args.kfacx_jax == "newest" else f"kfacx[jax{args.kfacx_jax}]"
    )


def kfacx_venv_name(base: str, args) -> str:
    """One venv per jax request: `kfacx` (newest jax) and e.g. `kfacx-jax0.10.2`."""
    return base if args.kfacx_jax == "newest" else f"{base}-jax{args.kfacx_jax}"


def probe_engine(
    venv: Path, engine: str, pythonpath: Path | None, extra: str = ""
) -> tuple[bool, str]:
    """Imports the engine's kfac_jax module (and extra code) in the venv."""
    mod = "kfac_jax" if engine == "kfac-jax" else "kfacx.kfac_jax"
    code = f"import {mod}\n{extra}"
    env = base_env(venv)
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    rc, _, out = run([venv / "bin" / "python", "-c", code], env=env, cwd=pythonpath or venv)
    return rc == 0, ("ok" if rc == 0 else last_error_line(out))


def jax_devices(venv: Path, devices: int) -> int | str:
    """jax.device_count() under the environment the tests get for `devices`."""
    rc, _, out = run(
        [venv / "bin" / "python", "-c", "import jax; print(jax.device_count())"],
        env=base_env(venv, devices),
        cwd=venv,
    )
    return int(out.strip().splitlines()[-1]) if rc == 0 else last_error_line(out)


_FERMINET_SRC = {}


def ferminet_source(args) -> Path:
    if "p" not in _FERMINET_SRC:
        _FERMINET_SRC["p"] = checkout(args.workdir, "ferminet", args.ferminet, None)
    return _FERMINET_SRC["p"]


# ----------------------------------------------------------------------------- junit


def parse_junit(path: Path) -> dict:
    res = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    if not path.exists():
        return res
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return res
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
            kind = "errors"
        else:
            kind = "failed"
        if bad is not None:
            res[kind] += 1
            msg = (bad.get("message") or bad.text or "").strip()
            # pytest's message is the exception's repr; keep its first line (and the
            # next one where the first is only "AssertionError:").
            lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
            first = lines[0] if lines else ""
            if first.endswith(":") and len(lines) > 1:
                first = f"{first} {lines[1]}"
            if bad.text and not re.search(r"(Error|Exception)", first):
                first = last_error_line(bad.text) or first
            res["failures"].append((name, first[:300]))
        elif case.find("skipped") is not None:
            res["skipped"] += 1
        else:
            res["passed"] += 1
    return res


def print_failures(label: str, failures: list, limit: int) -> None:
    if not failures:
        return
    groups: dict[str, list[str]] = {}
    for name, msg in failures:
        groups.setdefault(msg, []).append(name)
    log(f"  {label}: {len(failures)} failing, {len(groups)} distinct first lines:")
    for msg, names in sorted(groups.items(), key=lambda kv: -len(kv[1]))[:limit]:
        ex = ", ".join(names[:3]) + (f", ... (+{len(names) - 3})" if len(names) > 3 else "")
        log(f"    [{len(names)}x] {msg}\n         e.g. {ex}")


# ----------------------------------------------------------------------------- parts


def part_setup(args) -> None:
    rows = []
    for engine in args.engines:
        venv, note = engine_venv(args, engine)
        ok, msg = probe_engine(venv, engine, None) if venv else (False, note)
        rows.append(
            [
                engine,
                venv or "-",
                versions(venv) if venv else "-",
                note,
                "import ok" if ok else f"import failed: {msg}",
            ]
        )
    log(table(rows, ["engine", "venv", "versions", "built", "kfac_jax module"]))


def _ferminet_selection(tree: Path, mode: str, venv: Path) -> list[str]:
    """pytest node ids (or [] for the whole file) for train_test.py."""
    if mode == "all":
        return []
    if mode == "quick":
        return [f"ferminet/tests/train_test.py::{t}" for t in FERMINET_QUICK]
    # kfac: every test but the non-K-FAC ones. QmcTest.test_training_step<i> follow
    # _config_params(), whose code is evaluated here (it uses itertools only).
    src = (tree / "ferminet/tests/train_test.py").read_text()
    mod = ast.parse(src)
    fn = next(n for n in mod.body if isinstance(n, ast.FunctionDef) and n.name == "_config_params")
    ns: dict = {}
    exec("import itertools\n" + ast.get_source_segment(src, fn), ns)
    deselect = [
        f"QmcTest::test_training_step{i}"
        for i, p in enumerate(ns["_config_params"]())
        if p["optimizer"] != "kfac"
    ] + list(FERMINET_NON_KFAC)
    return ["--deselect=" + f"ferminet/tests/train_test.py::{d}" for d in deselect]


def part_ferminet_tests(args) -> None:
    src = ferminet_source(args)
    files = [f.strip() for f in args.ferminet_files.split(",") if f.strip()]
    rows, all_failures = [], []
    for engine in args.engines:
        tag = engine_tag(args, engine)
        venv, note = engine_venv(args, engine)
        if venv is None:
            rows += [[f, tag, "-", "venv failed", "", "", "", note[:120]] for f in files]
            continue
        tree = engine_copy(args.workdir, "ferminet", src, engine)
        ok, msg = probe_engine(
            venv, engine, tree, "import ferminet.train, ferminet.networks, ferminet.psiformer"
        )
        for devices in args.devices:
            seen = jax_devices(venv, devices)
            if ok and seen != devices:
                log(f"  {tag}: asked for {devices} devices, jax sees {seen}")
            for f in files:
                label = f"{tag}/{devices}dev/{f}"
                if not ok:
                    rows.append([f, tag, devices, "import failed", "", "", "", msg[:120]])
                    continue
                junit = args.workdir / "junit" / f"ferminet-{tag}-{devices}dev-{f}.xml"
                junit.unlink(missing_ok=True)  # a crashed run writes none: no stale results
                logp = args.workdir / "logs" / f"ferminet-{tag}-{devices}dev-{f}.log"
                sel = (
                    _ferminet_selection(tree, args.train_tests, venv)
                    if f == "train_test.py"
                    else []
                )
                targets = [a for a in sel if not a.startswith("--")] or [f"ferminet/tests/{f}"]
                opts = [a for a in sel if a.startswith("--")]
                if args.k:
                    opts += ["-k", args.k]
                env = base_env(venv, devices)
                env["PYTHONPATH"] = str(tree)
                rc, dt, _ = run(
                    [
                        venv / "bin" / "python",
                        "-m",
                        "pytest",
                        "-p",
                        "no:cacheprovider",
                        "-q",
                        "-rN",
                        f"--junitxml={junit}",
                        *opts,
                        *(["-n", str(args.xdist)] if args.xdist else []),
                        *targets,
                    ],
                    log_path=logp,
                    cwd=tree,
                    env=env,
                    timeout=args.test_timeout,
                )
                res = parse_junit(junit)
                status = "timeout" if rc == 124 else f"rc={rc}"
                rows.append(
                    [
                        f,
                        tag,
                        devices,
                        res["passed"],
                        res["failed"] + res["errors"],
                        res["skipped"],
                        f"{dt:.0f}s",
                        status,
                    ]
                )
                all_failures.append((label, res["failures"]))
                save_result(
                    args.workdir,
                    "ferminet-tests",
                    label,
                    {
                        **{k: res[k] for k in ("passed", "failed", "errors", "skipped")},
                        "seconds": round(dt, 1),
                        "rc": rc,
                        "selection": args.train_tests,
                        "versions": versions(venv),
                        "failures": res["failures"][:50],
                    },
                )
                log(
                    f"  {label}: {res['passed']} passed, {res['failed'] + res['errors']} failed, "
                    f"{res['skipped']} skipped in {dt:.0f}s ({status}; log {logp})"
                )
    log(f"\nFermiNet tests (train_test.py selection: {args.train_tests})")
    log(
        table(
            rows, ["test file", "engine", "devices", "passed", "failed", "skipped", "wall", "note"]
        )
    )
    for label, failures in all_failures:
        print_failures(label, failures, args.max_failure_lines)


def part_kfac_jax_tests(args) -> None:
    src = checkout(args.workdir, "kfac-jax", args.kfac_jax, args.kfac_jax_ref)
    files = sorted(p.name for p in (src / "tests").glob("test_*.py"))
    if args.kfac_jax_files:
        files = [f for f in files if any(s in f for s in args.kfac_jax_files.split(","))]
    rows, all_failures = [], []
    for engine in args.engines:
        tag = engine_tag(args, engine)
        venv, note = engine_venv(args, engine)
        if venv is None:
            rows += [[f, tag, "venv failed", "", "", "", note] for f in files]
            continue
        tree = engine_copy(args.workdir, "kfac-jax-tests", src, engine, subdirs=["tests"])
        ok, msg = probe_engine(venv, engine, tree, "from tests import models")
        for f in files:
            label = f"{tag}/{f}"
            if not ok:
                rows.append([f, tag, "", "", "", "", "import failed: " + msg[:100]])
                continue
            junit = args.workdir / "junit" / f"kfac-jax-tests-{tag}-{f}.xml"
            junit.unlink(missing_ok=True)  # a crashed run writes none: no stale results
            logp = args.workdir / "logs" / f"kfac-jax-tests-{tag}-{f}.log"
            env = base_env(venv)
            env["PYTHONPATH"] = str(tree)  # `from tests import models`
            rc, dt, out = run(
                [
                    venv / "bin" / "python",
                    "-m",
                    "pytest",
                    "-p",
                    "no:cacheprovider",
                    "-q",
                    "-rN",
                    f"--junitxml={junit}",
                    *(["-n", str(args.xdist)] if args.xdist else []),
                    *(["-k", args.k] if args.k else []),
                    f"tests/{f}",
                ],
                log_path=logp,
                cwd=tree,
                env=env,
                timeout=args.test_timeout,
            )
            res = parse_junit(junit)
            if rc not in (0, 1, 124) and not any(res[k] for k in ("passed", "failed", "errors")):
                res["failures"].append(("collection", last_error_line(out)))
                res["errors"] += 1
            status = "timeout" if rc == 124 else f"rc={rc}"
            rows.append(
                [
                    f,
                    tag,
                    res["passed"],
                    res["failed"] + res["errors"],
                    res["skipped"],
                    f"{dt:.0f}s",
                    status,
                ]
            )
            all_failures.append((label, res["failures"]))
            save_result(
                args.workdir,
                "kfac-jax-tests",
                label,
                {
                    **{k: res[k] for k in ("passed", "failed", "errors", "skipped")},
                    "seconds": round(dt, 1),
                    "rc": rc,
                    "versions": versions(venv),
                    "failures": res["failures"],
                },
            )
            log(
                f"  {label}: {res['passed']} passed, {res['failed'] + res['errors']} failed in "
                f"{dt:.0f}s ({status})"
            )
    log(f"\nkfac-jax {args.kfac_jax_ref} tests/")
    log(table(rows, ["test file", "engine", "passed", "failed", "skipped", "wall", "note"]))
    for label, failures in all_failures:
        print_failures(label, failures, args.max_failure_lines)


def part_energy(args) -> None:
    src = ferminet_source(args)
    results = {}
    for engine in args.engines:
        tag = engine_tag(args, engine)
        venv, note = engine_venv(args, engine)
        if venv is None:
            log(f"  {tag}: venv failed: {note}")
            continue
        tree = engine_copy(args.workdir, "ferminet", src, engine)
        ok, msg = probe_engine(venv, engine, tree, "import ferminet.train")
        for system in args.systems:
            suffix = "" if args.optimizer == "kfac" else f"-{args.optimizer}"
            label = f"{tag}/{system}/{args.devices[0]}dev{suffix}"
            if not ok:
                results[label] = {"error": "import failed: " + msg}
                continue
            out_dir = args.workdir / "energy" / f"{tag}-{system}-{args.devices[0]}dev{suffix}"
            if out_dir.exists():
                shutil.rmtree(out_dir)
            out_dir.mkdir(parents=True)
            env = base_env(venv, args.devices[0])
            env["PYTHONPATH"] = str(tree)
            cmd = [
                venv / "bin" / "python",
                Path(__file__).resolve(),
                "--_worker",
                "energy",
                "--_out",
                out_dir,
                "--_system",
                system,
                "--iterations",
                args.iterations,
                "--batch",
                args.batch,
                "--hidden",
                args.hidden,
                "--determinants",
                args.determinants,
                "--optimizer",
                args.optimizer,
                "--pretrain",
                args.pretrain,
                "--burn-in",
                args.burn_in,
                "--last",
                args.last,
                "--skip",
                args.skip,
            ]
            log(f"  {label}: training ({args.iterations} iterations, batch {args.batch}) ...")
            rc, dt, out = run(
                cmd, log_path=out_dir / "run.log", cwd=out_dir, env=env, timeout=args.energy_timeout
            )
            rj = out_dir / "result.json"
            if rc == 0 and rj.exists():
                results[label] = json.loads(rj.read_text())
                results[label]["wall"] = round(dt, 1)
                results[label]["versions"] = versions(venv)
            else:
                results[label] = {
                    "error": ("timeout" if rc == 124 else f"rc={rc}: ") + last_error_line(out),
                    "log": str(out_dir / "run.log"),
                }
            save_result(args.workdir, "energy", label, results[label])
            r = results[label]
            if "error" in r:
                log(f"    failed: {r['error']}")
            else:
                log(
                    f"    E = {r['energy_mean']:.5f} +- {r['energy_se']:.5f} Eh, "
                    f"{r['median_s_per_iter']:.4f} s/iter, total {dt:.0f}s"
                )
    rows = []
    saved = args.workdir / "results" / "energy.json"
    saved = json.loads(saved.read_text()) if saved.exists() else {}
    for system in args.systems:
        # the baseline of this run, else the last one saved (same config or not: see its row)
        suffix = "" if args.optimizer == "kfac" else f"-{args.optimizer}"
        key = f"kfac-jax/{system}/{args.devices[0]}dev{suffix}"
        base = results.get(key) or saved.get(key, {})
        for engine in args.engines:
            tag = engine_tag(args, engine)
            r = results.get(f"{tag}/{system}/{args.devices[0]}dev{suffix}")
            if r is None:
                continue
            if "error" in r:
                rows.append([system, tag, "-", "-", "-", "-", r["error"][:100]])
                continue
            ratio = (
                r["median_s_per_iter"] / base["median_s_per_iter"]
                if "median_s_per_iter" in base and engine != "kfac-jax"
                else None
            )
            rows.append(
                [
                    system,
                    tag,
                    r["iterations"],
                    f"{r['energy_mean']:.5f} +- {r['energy_se']:.5f}",
                    f"{r['median_s_per_iter']:.4f}",
                    f"{ratio:.2f}" if ratio else "-",
                    r.get("versions", ""),
                ]
            )
    log(
        f"\nFermiNet {args.optimizer} energy (last {args.last} of {args.iterations} iterations; "
        f"batch {args.batch}, hidden {args.hidden}, {args.determinants} determinants, pretrain "
        f"{args.pretrain}, {args.devices[0]} device(s); s/iter: median after the first {args.skip})"
    )
    log(
        table(
            rows, ["system", "engine", "iters", "energy (Eh)", "s/iter", "kfacx/kfac-jax", "note"]
        )
    )


DEEPQMC_NOTES = {
    "1.2.0": (
        "DeepQMC 1.2.0 (Sep 2024) installs and imports on Python 3.11 with jax 0.9.0 + "
        "kfac-jax 0.0.8, but is not a kfac-jax 0.0.8 client: its training fails on "
        "jax >= 0.6 (deepqmc/ewm.py calls jax.tree_map, removed in jax 0.6), and its "
        "kfacext.py was written for kfac-jax 0.0.6 (update_curvature_matrix_estimate "
        "without identity_weight, estimation_data['inputs'] as a dict, 'dense_tag' tag "
        "names, LayerTag(name, n_in, n_out)); 0.0.7 changed all of these. DeepQMC 1.3.0 "
        "(Python >= 3.12, jax < 0.9) is the release that uses kfac-jax 0.0.8's API: run "
        "--deepqmc-ref 1.3.0."
    ),
}


def _deepqmc_cli(args, venv: Path, tree: Path, name: str) -> str:
    """test_app.py's command (K-FAC training of H2), run directly: its last error line."""
    src = (tree / "tests" / "test_app.py").read_text()
    m = re.search(r"ARGS = \[(.*?)\]", src, re.S)
    cli_args = ast.literal_eval("[" + m.group(1) + "]") if m else ["deepqmc"]
    out_dir = args.workdir / "scratch" / name
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    env = dict(base_env(venv), HYDRA_FULL_ERROR="1")
    rc, _, out = run(
        [*cli_args, f"hydra.run.dir={out_dir}"],
        log_path=args.workdir / "logs" / f"{name}.log",
        cwd=out_dir,
        env=env,
        timeout=args.test_timeout,
    )
    return "ok" if rc == 0 else last_error_line(out)


def part_deepqmc(args) -> None:
    """DeepQMC: its tests/ (from the release's tag) under each engine."""
    for ref in args.deepqmc_refs:
        if ref in DEEPQMC_NOTES:
            log(f"\nDeepQMC {ref}: not run. " + DEEPQMC_NOTES[ref])
            save_result(args.workdir, "deepqmc", ref, {"not_run": DEEPQMC_NOTES[ref]})
            continue
        _deepqmc_ref(args, ref)


def _deepqmc_ref(args, ref: str) -> None:
    try:
        src = checkout(args.workdir, "deepqmc", args.deepqmc, ref)
    except SystemExit as e:
        log(
            f"deepqmc: its repository is needed for its tests and is not at hand ({e}); "
            f"pass --deepqmc PATH_OR_URL ({URLS['deepqmc']}, tag {ref})."
        )
        return
    rows, all_failures = [], []
    for engine in args.engines:
        tag = engine_tag(args, engine)
        tree = engine_copy(args.workdir, f"deepqmc-{ref}", src, engine)
        if engine == "kfac-jax":
            # deepqmc's own pins choose jax (1.3.0: jax < 0.9, so 0.8.x) for kfac-jax 0.0.8.
            venv, note = ensure_venv(
                args,
                f"deepqmc-{ref}-peer",
                args.deepqmc_python,
                [f"deepqmc=={ref}", "kfac-jax==0.0.8"] + DEEPQMC_DEPS,
            )
        else:
            jax_spec = (
                ["jax", "jaxlib"]
                if args.kfacx_jax == "newest"
                else [f"jax=={args.kfacx_jax}", f"jaxlib=={args.kfacx_jax}"]
            )
            # deepqmc from the rewritten source, without its requirements (kfac-jax, and
            # jax < 0.9 where kfacx needs >= 0.10.2); those it needs come from DEEPQMC_DEPS.
            venv, note = ensure_venv(
                args,
                kfacx_venv_name(f"deepqmc-{ref}-kfacx", args),
                args.deepqmc_python,
                jax_spec + DEEPQMC_DEPS,
                editable=REPO,
                no_deps=[str(tree)],
            )
        if venv is None:
            rows.append(["tests/", tag, "", "", "", "", "venv failed: " + note])
            continue
        ok, msg = probe_engine(venv, engine, None, "import deepqmc.optimizer, deepqmc.app")
        if not ok:
            rows.append(["tests/", tag, "", "", "", "", "import failed: " + msg[:120]])
            save_result(args.workdir, "deepqmc", f"{ref}/{tag}", {"import_failed": msg})
            continue
        junit = args.workdir / "junit" / f"deepqmc-{ref}-{tag}.xml"
        junit.unlink(missing_ok=True)  # a crashed run writes none: no stale results
        logp = args.workdir / "logs" / f"deepqmc-{ref}-{tag}.log"
        env = base_env(venv)
        targets = (
            [f"tests/{t}" for t in args.deepqmc_tests.split(",")]
            if args.deepqmc_tests
            else ["tests"]
        )
        # The copy's tests, run against the installed deepqmc (src/ layout: no shadowing);
        # test_app.py runs the venv's `deepqmc` command (K-FAC training of H2).
        rc, dt, out = run(
            [
                venv / "bin" / "python",
                "-m",
                "pytest",
                "-p",
                "no:cacheprovider",
                "-q",
                "-rN",
                f"--junitxml={junit}",
                *(["-n", str(args.xdist)] if args.xdist else []),
                *(["-k", args.k] if args.k else []),
                *targets,
            ],
            log_path=logp,
            cwd=tree,
            env=env,
            timeout=args.test_timeout,
        )
        res = parse_junit(junit)
        if any("test_app" in name for name, _ in res["failures"]):
            # test_app.py runs the `deepqmc` command and shows only its exit status: run
            # the command again here for the exception behind it.
            cli = _deepqmc_cli(args, venv, tree, f"deepqmc-{ref}-{tag}-cli")
            res["failures"] = [
                (name, f"{msg} <- deepqmc command: {cli}" if "test_app" in name else msg)
                for name, msg in res["failures"]
            ]
        status = "timeout" if rc == 124 else f"rc={rc}"
        rows.append(
            [
                "tests/",
                tag,
                res["passed"],
                res["failed"] + res["errors"],
                res["skipped"],
                f"{dt:.0f}s",
                f"{status}; {versions(venv)}",
            ]
        )
        all_failures.append((f"deepqmc {ref}/{tag}", res["failures"]))
        save_result(
            args.workdir,
            "deepqmc",
            f"{ref}/{tag}",
            {
                **{k: res[k] for k in ("passed", "failed", "errors", "skipped")},
                "seconds": round(dt, 1),
                "rc": rc,
                "versions": versions(venv),
                "failures": res["failures"],
            },
        )
        log(
            f"  deepqmc {ref}/{tag}: {res['passed']} passed, "
            f"{res['failed'] + res['errors']} failed in {dt:.0f}s ({status}; log {logp})"
        )
    log(f"\nDeepQMC {ref} tests/")
    log(table(rows, ["tests", "engine", "passed", "failed", "skipped", "wall", "note"]))
    for label, failures in all_failures:
        print_failures(label, failures, args.max_failure_lines)


# ----------------------------------------------------------------------------- names


class _Uses(ast.NodeVisitor):
    """kfac_jax.<chain> attribute uses, `from kfac_jax import` names, keyword arguments
    at kfac_jax.X(...) calls, and the methods of classes that subclass kfac_jax.X."""

    def __init__(self, alias: set[str], tree: ast.AST):
        self.alias = alias
        self.names: dict[str, set[int]] = {}
        self.kwargs: dict[str, set[str]] = {}
        self.subclasses: list[dict] = []
        # `utils = kfac_jax.utils` style aliases: name -> chain
        self.prefix: dict[str, str] = {}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                chain = self._chain(node.value)
                if chain is not None and node.targets[0].id not in alias:
                    self.prefix[node.targets[0].id] = chain

    def _chain(self, node) -> str | None:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in self.alias and parts:
            return ".".join(reversed(parts))
        if isinstance(node, ast.Name) and node.id in getattr(self, "prefix", {}):
            return ".".join([self.prefix[node.id], *reversed(parts)])
        return None

    def visit_ImportFrom(self, node):
        if node.module and node.module.split(".")[0] == "kfac_jax":
            prefix = node.module[len("kfac_jax") :].lstrip(".")
            for a in node.names:
                self.names.setdefault(f"{prefix}.{a.name}".lstrip("."), set()).add(node.lineno)

    def visit_Attribute(self, node):
        chain = self._chain(node)
        if chain is not None:
            self.names.setdefault(chain, set()).add(node.lineno)
            return  # the longest chain only
        self.generic_visit(node)

    def visit_Call(self, node):
        chain = self._chain(node.func)
        if chain is not None:
            kw = {k.arg for k in node.keywords if k.arg}
            self.kwargs.setdefault(chain, set()).update(kw)
        self.generic_visit(node)

    def visit_ClassDef(self, node):
        bases = [self._chain(b) for b in node.bases]
        bases = [b for b in bases if b]
        if bases:
            methods = []
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    a = item.args
                    params = (
                        [x.arg for x in a.posonlyargs + a.args]
                        + (["*" + a.vararg.arg] if a.vararg else [])
                        + [x.arg for x in a.kwonlyargs]
                        + (["**" + a.kwarg.arg] if a.kwarg else [])
                    )
                    calls_super = any(
                        isinstance(n, ast.Call)
                        and isinstance(n.func, ast.Attribute)
                        and isinstance(n.func.value, ast.Call)
                        and getattr(n.func.value.func, "id", "") == "super"
                        for n in ast.walk(item)
                    )
                    attrs = sorted(
                        {
                            n.attr
                            for n in ast.walk(item)
                            if isinstance(n, ast.Attribute)
                            and isinstance(n.value, ast.Name)
                            and n.value.id == "self"
                        }
                    )
                    methods.append(
                        {
                            "name": item.name,
                            "params": params,
                            "calls_super": calls_super,
                            "self_attrs": attrs,
                        }
                    )
            self.subclasses.append(
                {"class": node.name, "bases": bases, "line": node.lineno, "methods": methods}
            )
        self.generic_visit(node)


def scan_names(root: Path, globs: list[str]) -> dict:
    out = {"names": {}, "kwargs": {}, "subclasses": [], "yaml": {}}
    for g in globs:
        for path in sorted(root.glob(g)):
            rel = str(path.relative_to(root))
            text = path.read_text(errors="replace")
            if path.suffix in (".yaml", ".yml"):
                for m in re.finditer(r"_target_:\s*['\"]?(kfac_jax\.[\w.]+)", text):
                    out["yaml"].setdefault(m.group(1)[len("kfac_jax.") :], []).append(rel)
                    keys = _yaml_sibling_keys(text, m.start())
                    out["kwargs"].setdefault(m.group(1)[len("kfac_jax.") :], set()).update(keys)
                    out["names"].setdefault(m.group(1)[len("kfac_jax.") :], set()).add(rel)
                continue
            if "kfac_jax" not in text:
                continue
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue
            alias = {"kfac_jax"}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name == "kfac_jax":
                            alias.add(a.asname or "kfac_jax")
            v = _Uses(alias, tree)
            v.visit(tree)
            for n, lines in v.names.items():
                out["names"].setdefault(n, set()).update(f"{rel}:{ln}" for ln in sorted(lines))
            for n, kw in v.kwargs.items():
                out["kwargs"].setdefault(n, set()).update(kw)
            for s in v.subclasses:
                out["subclasses"].append({**s, "file": rel})
    return out


def _yaml_sibling_keys(text: str, pos: int) -> set[str]:
    """Keys at the same indentation as a `_target_:` line, in its block."""
    lines = text[:pos].splitlines()
    line_start = text.rfind("\n", 0, pos) + 1
    indent = pos - line_start
    rest = text[line_start:].splitlines()
    keys = set()
    block_start = len(lines) - 1
    all_lines = text.splitlines()
    # walk up and down while the indentation is >= indent
    for direction in (-1, 1):
        i = block_start
        while 0 <= i < len(all_lines):
            ln = all_lines[i]
            if ln.strip():
                ind = len(ln) - len(ln.lstrip())
                if ind < indent:
                    break
                if ind == indent:
                    m = re.match(r"\s*([\w]+):", ln)
                    if m and m.group(1) not in ("_target_", "_partial_"):
                        keys.add(m.group(1))
            i += direction
    del rest
    return keys


def part_names(args) -> None:
    sources = []
    fsrc = ferminet_source(args)
    sources.append(("FermiNet", fsrc, ["ferminet/**/*.py"], lambda p: "/tests/" not in p))
    for ref in args.deepqmc_refs:
        try:
            dsrc = checkout(args.workdir, "deepqmc", args.deepqmc, ref)
            sources.append((f"DeepQMC {ref}", dsrc, ["src/**/*.py", "src/**/*.yaml"], None))
        except SystemExit as e:
            log(f"(DeepQMC {ref} not scanned: {e})")
    ksrc = checkout(args.workdir, "kfac-jax", args.kfac_jax, args.kfac_jax_ref)
    sources.append((f"kfac-jax {args.kfac_jax_ref} tests", ksrc, ["tests/*.py"], None))

    scans = {}
    for label, root, globs, keep in sources:
        s = scan_names(root, globs)
        if keep:
            s["names"] = {n: {x for x in where if keep(x)} for n, where in s["names"].items()}
            s["names"] = {n: w for n, w in s["names"].items() if w}
        scans[label] = s
    all_names = sorted({n for s in scans.values() for n in s["names"]})
    # Resolve under each engine (attribute chains and base-class method signatures).
    resolved = {}
    bases = sorted({b for s in scans.values() for c in s["subclasses"] for b in c["bases"]})
    for engine in args.engines:
        venv, note = engine_venv(args, engine)
        if venv is None:
            log(f"{engine}: venv failed ({note}); names not resolved")
            continue
        inp = args.workdir / "results" / "names-input.json"
        inp.parent.mkdir(parents=True, exist_ok=True)
        inp.write_text(
            json.dumps(
                {
                    "names": all_names,
                    "bases": bases,
                    "methods": sorted(
                        {
                            m["name"]
                            for s in scans.values()
                            for c in s["subclasses"]
                            for m in c["methods"]
                        }
                    ),
                }
            )
        )
        outp = args.workdir / "results" / f"names-{engine}.json"
        rc, _, out = run(
            [
                venv / "bin" / "python",
                Path(__file__).resolve(),
                "--_worker",
                "names",
                "--_engine",
                engine,
                "--_in",
                inp,
                "--_out",
                outp,
            ],
            env=base_env(venv),
            cwd=args.workdir,
        )
        if rc == 0 and outp.exists():
            resolved[engine] = json.loads(outp.read_text())
        else:
            log(f"{engine}: name resolution failed: {last_error_line(out)}")

    def mark(name):
        out = []
        for engine in args.engines:
            r = resolved.get(engine, {}).get("names", {}).get(name)
            if r is not None:
                out.append(f"{engine}:{'ok' if r == 'ok' else 'MISSING(' + r + ')'}")
        return " ".join(out)

    for label, s in scans.items():
        log(f"\n== {label}: {len(s['names'])} kfac_jax names")
        for n in sorted(s["names"]):
            where = sorted(s["names"][n])
            files = sorted({w.split(":")[0] for w in where})
            kws = sorted(s["kwargs"].get(n, ()))
            log(
                f"  kfac_jax.{n:<48} {mark(n):<28} {len(where)} uses in {', '.join(files)}"
                + (f"\n      keywords: {', '.join(kws)}" if kws else "")
            )
        for c in s["subclasses"]:
            log(
                f"  class {c['class']}({', '.join('kfac_jax.' + b for b in c['bases'])})"
                f"  [{c['file']}:{c['line']}]"
            )
            for m in c["methods"]:
                sigs = []
                for engine in args.engines:
                    sig = (
                        resolved.get(engine, {})
                        .get("methods", {})
                        .get(f"{c['bases'][0]}.{m['name']}")
                    )
                    if sig is not None:
                        sigs.append(f"{engine}{sig}")
                log(
                    f"      def {m['name']}({', '.join(m['params'])})"
                    + (" -> super()" if m["calls_super"] else "")
                    + (
                        f"  self.{{{', '.join(a for a in m['self_attrs'] if a != m['name'])}}}"
                        if m["self_attrs"]
                        else ""
                    )
                )
                for sg in sigs:
                    log(f"          base {sg}")
        if s["yaml"]:
            log(
                "  hydra _target_ strings: "
                + ", ".join(f"kfac_jax.{k} ({len(v)} files)" for k, v in s["yaml"].items())
            )
    # kfac-jax's tests: which file exercises which name.
    kt = scans.get(f"kfac-jax {args.kfac_jax_ref} tests")
    if kt:
        by_file: dict[str, set[str]] = {}
        for n, where in kt["names"].items():
            for w in where:
                by_file.setdefault(w.split(":")[0], set()).add(n)
        log(f"\n== kfac-jax {args.kfac_jax_ref} tests, names per file")
        for f in sorted(by_file):
            log(f"  {f}: " + ", ".join(sorted(by_file[f])))
    save_result(
        args.workdir,
        "names",
        "scan",
        {
            label: {
                "names": {n: sorted(w) for n, w in s["names"].items()},
                "kwargs": {n: sorted(k) for n, k in s["kwargs"].items()},
                "subclasses": s["subclasses"],
                "yaml": s["yaml"],
            }
            for label, s in scans.items()
        },
    )
    save_result(args.workdir, "names", "resolved", resolved)


# ----------------------------------------------------------------------------- workers
# These run inside a virtualenv (jax importable); argv: --_worker NAME ...


def worker_names(args) -> None:
    import importlib
    import inspect

    mod_name = "kfac_jax" if args._engine == "kfac-jax" else "kfacx.kfac_jax"
    inp = json.loads(Path(args._in).read_text())
    out = {"names": {}, "methods": {}}
    try:
        root = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - reported, not raised
        out["import_error"] = f"{type(e).__name__}: {e}"
        out["names"] = {n: "module import failed" for n in inp["names"]}
        Path(args._out).write_text(json.dumps(out))
        return

    def resolve(chain):
        obj = root
        done = []
        for part in chain.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                try:  # a submodule not imported by the package
                    obj = importlib.import_module(".".join([mod_name, *done, part]))
                except Exception:  # noqa: BLE001
                    return None, ".".join(done + [part])
            done.append(part)
        return obj, None

    for n in inp["names"]:
        obj, missing = resolve(n)
        out["names"][n] = "ok" if missing is None else f"no {missing}"
    for b in inp["bases"]:
        cls, missing = resolve(b)
        if missing:
            continue
        for m in inp["methods"]:
            fn = getattr(cls, m, None)
            if fn is None:
                continue
            try:
                sig = inspect.signature(fn)  # without annotations: short and comparable
                out["methods"][f"{b}.{m}"] = (
                    "("
                    + ", ".join(
                        str(q.replace(annotation=inspect.Parameter.empty))
                        for q in sig.parameters.values()
                    )
                    + ")"
                )
            except (TypeError, ValueError):
                out["methods"][f"{b}.{m}"] = "(?)"
    Path(args._out).write_text(json.dumps(out))


def worker_energy(args) -> None:
    """FermiNet K-FAC training of a diatomic; timing per iteration from the writer."""
    import numpy as np
    from absl import flags, logging

    flags.FLAGS.mark_as_parsed()
    logging.set_verbosity(logging.WARNING)
    import jax  # noqa: F401
    from ferminet import base_config, train
    from ferminet.configs import diatomic

    cfg = diatomic.get_config()
    cfg.system.molecule_name = args._system
    cfg.batch_size = args.batch
    width, small = (
        (int(x) for x in args.hidden.split("x"))
        if "x" in args.hidden
        else (int(args.hidden), max(int(args.hidden) // 4, 4))
    )
    cfg.network.ferminet.hidden_dims = ((width, small),) * 2
    cfg.network.determinants = args.determinants
    cfg.pretrain.iterations = args.pretrain
    cfg.mcmc.burn_in = args.burn_in
    # FermiNet adapts the MCMC move width every 100 iterations from 0.02, which leaves
    # the walkers nearly frozen (pmove ~0.97) over a few hundred iterations of a small
    # molecule and biases the energy; adapt every 10 iterations instead.
    cfg.mcmc.adapt_frequency = 10
    cfg.optim.optimizer = args.optimizer
    cfg.optim.iterations = args.iterations
    cfg.debug.deterministic = True  # the same seed (23) for every engine
    cfg.log.save_path = str(Path(args._out) / "ckpt")
    cfg.log.save_frequency = 1e6  # minutes: no checkpoint during the run
    cfg = base_config.resolve(cfg)

    rows: list[dict] = []

    class TimedWriter(contextlib.AbstractContextManager):
        def write(self, t, **data):
            rows.append(
                {
                    "t": t,
                    "time": time.perf_counter(),
                    **{k: float(np.asarray(v).mean()) for k, v in data.items()},
                }
            )

        def flush(self):
            pass

        def __exit__(self, *exc):
            return None

    t0 = time.perf_counter()
    train.train(cfg, writer_manager=TimedWriter())
    total = time.perf_counter() - t0
    keys = list(rows[0].keys())
    with open(Path(args._out) / "train_stats.csv", "w") as f:
        f.write(",".join(keys) + "\n")
        for r in rows:
            f.write(",".join(str(r[k]) for k in keys) + "\n")
    energy = np.array([r["energy"] for r in rows])
    times = np.array([r["time"] for r in rows])
    dts = np.diff(times)[args.skip :]
    last = energy[-args.last :]
    se_naive = float(last.std(ddof=1) / np.sqrt(len(last)))
    # the energies of successive iterations are correlated: the error of the mean is
    # taken from 10 blocks of consecutive iterations
    block = max(1, len(last) // 10)
    means = last[: block * (len(last) // block)].reshape(-1, block).mean(axis=1)
    se = float(means.std(ddof=1) / np.sqrt(len(means))) if len(means) > 1 else se_naive
    result = {
        "system": args._system,
        "iterations": len(rows),
        "last": len(last),
        "energy_mean": float(last.mean()),
        "energy_se": se,
        "energy_se_naive": se_naive,
        "reblock_size": block,
        "energy_final": float(energy[-1]),
        "median_s_per_iter": float(np.median(dts)),
        "mean_s_per_iter": float(dts.mean()),
        "first_iter_s": float(times[0] - t0) if len(times) else None,
        "total_s": total,
        "devices": jax.device_count(),
        "config": {
            "batch": args.batch,
            "hidden": list(cfg.network.ferminet.hidden_dims[0]),
            "determinants": args.determinants,
            "optimizer": args.optimizer,
            "pretrain": args.pretrain,
            "burn_in": args.burn_in,
        },
    }
    Path(args._out, "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


# ----------------------------------------------------------------------------- main


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Parts: " + ", ".join(PARTS) + ". See the module docstring for details.",
    )
    p.add_argument(
        "--part",
        action="append",
        default=None,
        help="what to run (comma-separated or repeated): "
        + ", ".join(PARTS)
        + ", all (everything but setup, which the others do as needed)",
    )
    p.add_argument("--engine", default="both", help="kfac-jax (the peer), kfacx, or both")
    p.add_argument(
        "--devices", default="1,2", help="1, 2 or 1,2 (virtual CPU devices); energy uses the first"
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path("/work/clients"),
        help="venvs, checkouts, logs and results (default /work/clients)",
    )
    p.add_argument("--rebuild", action="store_true", help="rebuild the virtualenvs")
    p.add_argument(
        "--ferminet",
        default=DEFAULT_FERMINET,
        help="FermiNet: a work tree (used as is) or a git dir/URL to clone "
        f"(default {DEFAULT_FERMINET}, else {URLS['ferminet']})",
    )
    p.add_argument("--kfac-jax", default=DEFAULT_KFAC_JAX, help="kfac-jax's repository (its tests)")
    p.add_argument("--kfac-jax-ref", default="v0.0.8")
    p.add_argument("--deepqmc", default=DEFAULT_DEEPQMC, help="DeepQMC's repository (its tests)")
    p.add_argument(
        "--deepqmc-ref",
        default="1.3.0",
        help="DeepQMC release(s), comma-separated: 1.3.0 runs (Python 3.12); 1.2.0 "
        "is explained, not run (it predates kfac-jax 0.0.7's API)",
    )
    p.add_argument("--deepqmc-python", default="3.12", help="Python of the DeepQMC venvs")
    p.add_argument(
        "--deepqmc-tests",
        default="",
        help="comma-separated files under DeepQMC's tests/ (default: all)",
    )
    p.add_argument("--peer-python", default="3.11", help="Python of the kfac-jax venvs")
    p.add_argument(
        "--kfacx-python",
        default="3.12",
        help="Python of the kfacx venv (jax >= 0.11 needs 3.12; on 3.11 the newest jax is 0.10.2)",
    )
    p.add_argument("--kfacx-jax", default="newest", help="jax version for the kfacx venvs")
    p.add_argument("--ferminet-files", default="train_test.py,networks_test.py,psiformer_test.py")
    p.add_argument(
        "--train-tests",
        default="kfac",
        choices=("kfac", "all", "quick"),
        help="train_test.py cases: the K-FAC ones (32 of 44), all, or 9 of them",
    )
    p.add_argument("--kfac-jax-files", default="", help="substrings of kfac-jax test files")
    p.add_argument("-k", default="", help="pytest -k expression for the test parts")
    p.add_argument("--xdist", type=int, default=0, help="pytest-xdist workers (0: none)")
    p.add_argument("--test-timeout", type=int, default=3600, help="seconds per pytest run")
    p.add_argument("--max-failure-lines", type=int, default=12)
    g = p.add_argument_group("energy")
    g.add_argument("--systems", default="H2,LiH", help="comma-separated: H2, LiH, ...")
    g.add_argument("--iterations", type=int, default=500)
    g.add_argument("--batch", type=int, default=256)
    g.add_argument("--hidden", default="32x8", help="one-electron x two-electron widths")
    g.add_argument("--determinants", type=int, default=4)
    g.add_argument(
        "--optimizer",
        default="kfac",
        choices=("kfac", "adam"),
        help="FermiNet's optimizer: adam times the engines' JAX versions without K-FAC",
    )
    g.add_argument("--pretrain", type=int, default=100, help="HF pretraining iterations")
    g.add_argument("--burn-in", type=int, default=50)
    g.add_argument("--last", type=int, default=200, help="iterations averaged")
    g.add_argument("--skip", type=int, default=10, help="first iterations left out of s/iter")
    g.add_argument("--energy-timeout", type=int, default=3600)
    for hidden in ("--_worker", "--_engine", "--_in", "--_out", "--_system"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args._worker:
        {"names": worker_names, "energy": worker_energy}[args._worker](args)
        return

    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.engines = list(ENGINES) if args.engine == "both" else [args.engine]
    if any(e not in ENGINES for e in args.engines):
        p.error(f"--engine: one of {', '.join(ENGINES)}, both")
    args.devices = [int(d) for d in str(args.devices).split(",")]
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.deepqmc_refs = [r.strip() for r in args.deepqmc_ref.split(",") if r.strip()]
    parts = [x.strip() for item in (args.part or ["all"]) for x in item.split(",") if x.strip()]
    if "all" in parts:
        parts = [x for x in PARTS if x != "setup"]
    for part in parts:
        if part not in PARTS:
            p.error(f"--part: one of {', '.join(PARTS)}, all")
    funcs = {
        "setup": part_setup,
        "names": part_names,
        "ferminet-tests": part_ferminet_tests,
        "kfac-jax-tests": part_kfac_jax_tests,
        "energy": part_energy,
        "deepqmc": part_deepqmc,
    }
    for part in parts:
        log(f"\n### {part} (engines: {', '.join(args.engines)}; workdir {args.workdir})")
        t0 = time.perf_counter()
        funcs[part](args)
        log(f"### {part} done in {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
