"""The wrap route's container image, built here with no registry, cached by the hash of its inputs.

    python scripts/pod_image.py [--cache DIR]     # prints the image tarball's path (default: DEFAULT_CACHE)

What a cluster's image is, from what we ship: deploy/Containerfile (the file operators build from
their own workload image) run by ``podman build`` on a local base, with our wheel and its
dependencies in the build context, so the image is also a test of the wheel as users install it.

1. base: a Debian rootfs of this machine's release from its own apt mirror (mmdebstrap; the
   workload's Python, no more), ``podman import``-ed (import sets no PATH: we set it);
2. context: the wheel built from this checkout, its dependencies for the base's Python
   (``pip download``, binary wheels), scripts/install-criu.sh;
3. ``podman build -f deploy/Containerfile --build-arg BASE=<base>``: CRIU >= 4 and our CLI in its
   own venv;
4. ``podman save`` to DIR/pod-image-<key>.tar, where key hashes every input above (the wheel by its
   members, since a wheel's zip bytes carry timestamps). A later run with the same inputs loads that
   tarball (seconds) instead of building (about a minute).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from local_parts import copy_build_inputs  # noqa: E402
from pod_runtime import PodError, PodRuntime  # noqa: E402

CONTAINERFILE = REPO / "deploy" / "Containerfile"
IMAGE = "localhost/cedana-airflow-pod"
#: The base stands in for an operator's workload image: Debian with Python, nothing of ours.
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Machine-wide where it may be written (as root: a clean clone, CI's, finds the base and an unchanged image
#: there, as the compat venvs under /opt are found), else in the checkout; CEDANA_IMAGE_CACHE chooses another.
MACHINE_CACHE = Path("/var/cache/cedana-airflow/images")


def _default_cache() -> Path:
    if chosen := os.environ.get("CEDANA_IMAGE_CACHE"):
        return Path(chosen)
    return MACHINE_CACHE if os.geteuid() == 0 else REPO / ".cedana" / "images"


DEFAULT_CACHE = _default_cache()


def _say(msg: str) -> None:
    print(f"pod-image: {msg}", file=sys.stderr, flush=True)


def release_and_mirror() -> tuple[str, str]:
    """This machine's Debian codename and the mirror its apt sources name (the image follows the host)."""
    osr = dict(line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line)
    codename = osr.get("VERSION_CODENAME", "").strip('"')
    if not codename:
        raise PodError("no VERSION_CODENAME in /etc/os-release: the pod image is built on Debian only")
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    text = "\n".join(p.read_text(errors="replace") for p in sources if p.is_file())
    for m in re.finditer(r"^(?:URIs:\s*(\S+)|deb\s+(?:\[[^]]*\]\s+)?(\S+))", text, re.M):
        url = m.group(1) or m.group(2)
        if "security" not in url:
            return codename, url
    return codename, "http://deb.debian.org/debian"


def supervisor_requirements() -> list[str]:
    """What the pod's supervisor needs beside our wheel (installed --no-deps): pyproject's supervisor group,
    the package's dependencies without Airflow, which the pod never runs."""
    import tomllib

    return list(tomllib.loads((REPO / "pyproject.toml").read_text())["dependency-groups"]["supervisor"])


def _wheel_digest(wheel: Path) -> str:
    h = hashlib.sha256()
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(z.namelist()):
            h.update(name.encode() + b"\0" + z.read(name))
    return h.hexdigest()


def _run(cmd: list[str], what: str, timeout: float = 600, env: dict[str, str] | None = None) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        last = [line for line in r.stderr.splitlines() if line.strip()][-3:]
        raise PodError(f"{what} failed ({' '.join(cmd[:3])} ...): {' | '.join(last)}")
    return r.stdout


def base_rootfs(codename: str, mirror: str, cache: Path) -> tuple[Path, str, str]:
    """(the base rootfs tarball, its image reference, its Python as "3.X"), made with mmdebstrap when missing."""
    key = hashlib.sha256(f"{codename}\n{mirror}\n{','.join(BASE_PACKAGES)}\n{PATH_ENV}".encode()).hexdigest()[:16]
    ref = f"localhost/cedana-airflow-base:{key}"
    tar = cache / f"base-{codename}-{key}.tar"
    python = tar.with_suffix(".python")
    if not tar.exists():
        t0 = time.monotonic()
        _say(f"making a Debian {codename} rootfs from {mirror} (mmdebstrap, about 30 s)")
        part = tar.with_suffix(".part")
        # Its chroot (with /proc, /sys and /dev mounted on it for a minute) in a folder of root's alone, not in
        # /tmp where any user reaches it: the node agent gives a tree of a caller other than root every mount
        # that caller reaches, and a tree started meanwhile could not be restored once they were gone.
        with tempfile.TemporaryDirectory(prefix="cedana-mmdebstrap-") as private:
            _run(["mmdebstrap", "--quiet", "--variant=apt", "--format=tar", f"--include={','.join(BASE_PACKAGES)}",
                  codename, str(part), mirror], "mmdebstrap", timeout=900, env={**os.environ, "TMPDIR": private})
        part.rename(tar)
        _say(f"rootfs ready in {time.monotonic() - t0:.0f} s ({tar.stat().st_size >> 20} MiB)")
    if not python.exists():  # /usr/bin/python3 -> python3.X: which wheels the image's venv takes
        with tarfile.open(tar) as t:
            link = next(m.linkname for m in t if m.name.lstrip("./") == "usr/bin/python3")
        python.write_text(link.removeprefix("python"))
    return tar, ref, python.read_text().strip()


def _apt_allows_expired() -> bool:
    """Whether this host's apt accepts a Release past its Valid-Until (a snapshot mirror's setting): the
    image's build then does too, for the testing suite install-criu.sh takes CRIU from."""
    r = subprocess.run(["apt-config", "dump"], capture_output=True, text=True)
    return 'Acquire::Check-Valid-Until "false"' in r.stdout


def build(cache: Path = DEFAULT_CACHE, rt: PodRuntime | None = None, python: str = sys.executable) -> tuple[Path, str]:
    """(the image tarball, its reference), built or found in ``cache``. ``rt``: a runtime to build in
    (a private throwaway one by default); the image is left loaded in it."""
    cache.mkdir(parents=True, exist_ok=True)
    codename, mirror = release_and_mirror()
    with tempfile.TemporaryDirectory(prefix="cedana-pod-image-") as tmp:
        ctx = Path(tmp) / "context"
        wheels = ctx / "wheels"
        wheels.mkdir(parents=True)
        src = copy_build_inputs(Path(tmp) / "src")
        _run([python, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--disable-pip-version-check",
              str(src), "-w", str(wheels)], "building cedana-airflow's wheel")
        [wheel] = wheels.glob("cedana_airflow-*.whl")
        own = rt is None
        runtime = rt or PodRuntime(Path(tmp) / "podman")
        try:
            base_tar, base, pyver = base_rootfs(codename, mirror, cache)
            abi = "cp" + pyver.replace(".", "")
            _run([python, "-m", "pip", "download", "-q", "--disable-pip-version-check", "-d", str(wheels),
                  "--only-binary=:all:", "--python-version", pyver, "--implementation", "cp", "--abi", abi,
                  *(a for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
                    for a in ("--platform", p)),
                  *supervisor_requirements()],
                 "downloading the wheel's dependencies", timeout=600)
            (ctx / "install-criu.sh").write_bytes((REPO / "scripts" / "install-criu.sh").read_bytes())
            h = hashlib.sha256()
            h.update(base.encode())
            h.update(CONTAINERFILE.read_bytes())
            h.update((ctx / "install-criu.sh").read_bytes())
            h.update(_wheel_digest(wheel).encode())
            for w in sorted(wheels.iterdir()):
                h.update(w.name.encode())  # the dependencies, by name and version
            key = h.hexdigest()[:16]
            ref = f"{IMAGE}:{key}"
            tar = cache / f"pod-image-{key}.tar"
            if tar.exists():
                _say(f"cached: {tar.name}")
                runtime.podman("load", "-q", "-i", str(tar), timeout=600)
                return tar, ref
            runtime.podman("import", "--change", f"ENV {PATH_ENV}", str(base_tar), base, timeout=600)
            t0 = time.monotonic()
            _say(f"podman build -f deploy/Containerfile (BASE {base}, Python {pyver})")
            runtime.podman("build", "-q", "-f", str(CONTAINERFILE), "--build-arg", f"BASE={base}",
                           "--build-arg", f"CEDANA_APT_ALLOW_EXPIRED={'1' if _apt_allows_expired() else ''}",
                           "-t", ref, str(ctx), timeout=900)
            part = tar.with_suffix(".part")
            part.unlink(missing_ok=True)
            runtime.podman("save", "-q", "-o", str(part), ref, timeout=600)
            part.rename(tar)
            for old in cache.glob("pod-image-*.tar"):  # one image kept: the inputs it was built from are gone
                if old != tar:
                    old.unlink()
            _say(f"built {ref} in {time.monotonic() - t0:.0f} s ({tar.stat().st_size >> 20} MiB)")
            return tar, ref
        finally:
            if own:
                runtime.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = ap.parse_args()
    try:
        tar, ref = build(args.cache)
    except PodError as e:
        print(f"pod-image: {e}", file=sys.stderr)
        return 1
    print(tar)
    return 0


if __name__ == "__main__":
    sys.exit(main())
