"""``$DZCTL_HOME/calibration.json``: ``dzctl tune``'s measured choices, read once per plan and written atomically.

What the records mean is ``planning/calibration.py``'s (pure); here only the file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..observe.store import dzctl_home
from ..planning.speed.calibration import (
    Calibration,
    CalibrationInput,
    calibrations_text,
    parse_calibrations,
    with_record,
)

CALIBRATION_FILE = "calibration.json"


def calibration_path() -> Path:
    return dzctl_home() / CALIBRATION_FILE


def read_records(path: Path | None = None) -> dict[str, Calibration]:
    """Every record in the file (none when there is no file yet); a broken file is bad input naming it."""
    path = path or calibration_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    return parse_calibrations(text, str(path))


def calibration_input(kind: str | None) -> CalibrationInput:
    """What a plan reads: the records, and the nodes' GPU kind (planning/calibration.py's ``kind_of``)."""
    return CalibrationInput(read_records(), kind)


def write_record(record: Calibration, path: Path | None = None) -> Path:
    """Add (or replace) one key's record. The file is replaced whole through a temporary file of a unique name
    in the same folder: a reader never sees half a file, and two tunes never write into one temp file."""
    path = path or calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    text = calibrations_text(with_record(read_records(path), record))
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return path
