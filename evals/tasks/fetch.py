"""Fetch the DataFrameBench wheel into the data cache (``python -m evals.tasks.fetch``).

The wheel declares Python 3.12 but holds only data, so it is downloaded with
``pip download --python-version 3.12`` and read in place (never installed).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from app.core.paths import data_dir

DATAFRAMEBENCH = "dataframebench==0.1.1"


def dataframebench_wheel() -> Path | None:
    """The cached DataFrameBench wheel, if fetched."""
    found = sorted(data_dir().glob("dataframebench-0.1.1-*.whl"))
    return found[-1] if found else None


def fetch_dataframebench() -> Path:
    """Download the DataFrameBench wheel into the data cache (no-op if present).

    Raises:
        subprocess.CalledProcessError: pip could not download it.
    """
    wheel = dataframebench_wheel()
    if wheel is not None:
        return wheel
    data_dir().mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--python-version",
            "3.12",
            "--only-binary=:all:",
            "-q",
            "-d",
            str(data_dir()),
            DATAFRAMEBENCH,
        ],
        check=True,
    )
    wheel = dataframebench_wheel()
    assert wheel is not None
    return wheel


if __name__ == "__main__":
    print(fetch_dataframebench())
