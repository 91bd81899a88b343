"""MovieLens ratings files: reading every GroupLens layout, and fetching MovieLens-100k.

MovieLens-100k (GroupLens; 100,000 ratings, 943 users, 1,682 items) travels inside the
`recbole==1.2.1` wheel on PyPI as `recbole/dataset_example/ml-100k/ml-100k.inter`, so it is
fetched with `pip download --no-deps` into a cache and read from the zip: recbole itself is
never installed or imported. Files a user downloads from GroupLens are read by path:

- RecBole atomic files (`*.inter`): tab-separated, a `name:type` header;
- ML-100k `u.data`: tab-separated `user item rating timestamp`, no header;
- ML-1M / ML-10M `ratings.dat`: `user::item::rating::timestamp`;
- ML-20M / ML-25M / latest `ratings.csv`: `userId,movieId,rating,timestamp` with a header.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from manualpar.errors import DataFileError

__all__ = ["Ratings", "default_cache", "fetch_movielens_100k", "read_ratings"]

RECBOLE_WHEEL = "recbole==1.2.1"
ML100K_MEMBER = "recbole/dataset_example/ml-100k/ml-100k.inter"


@dataclass(frozen=True)
class Ratings:
    """One rating per entry, in file order (a protocol keeps that order for equal times)."""

    users: list[str]  # tokens as in the file
    items: list[str]
    timestamps: list[float]
    source: str

    def __len__(self) -> int:
        return len(self.users)


def default_cache() -> Path:
    """$MANUALPAR_DATA/movielens, or ~/.cache/manualpar/movielens."""
    root = os.environ.get("MANUALPAR_DATA", Path.home() / ".cache" / "manualpar")
    return Path(root) / "movielens"


def fetch_movielens_100k(cache: str | Path | None = None) -> Path:
    """ml-100k.inter in `cache` (default: `default_cache()`), fetched once with pip (every
    process may call it: a file lock makes one download and the others wait for it)."""
    cache = Path(cache) if cache is not None else default_cache()
    target = cache / "ml-100k.inter"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():  # another process fetched it while this one waited
            return target
        wheel = next(cache.glob("recbole-1.2.1-*.whl"), None) or _download_wheel(cache)
        with zipfile.ZipFile(wheel) as archive:
            partial = target.with_suffix(".partial")
            partial.write_bytes(archive.read(ML100K_MEMBER))
            partial.replace(target)
    return target


def _download_wheel(cache: Path) -> Path:
    print(f"fetching MovieLens-100k ({RECBOLE_WHEEL}'s wheel, 2 MB) into {cache}")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
    done = subprocess.run(
        [*command, RECBOLE_WHEEL, "-d", str(cache)], capture_output=True, text=True
    )
    wheel = next(cache.glob("recbole-1.2.1-*.whl"), None)
    if done.returncode or wheel is None:
        raise DataFileError(
            f"could not download {RECBOLE_WHEEL} with pip into {cache} (exit "
            f"{done.returncode}): {done.stderr.strip()[-500:]}. Download ml-100k from GroupLens "
            "yourself and read its u.data by path"
        )
    return wheel


def read_ratings(path: str | Path) -> Ratings:
    """Every rating of a MovieLens file in any of the layouts above, in file order. Raises
    DataFileError naming the file (and line) when it cannot be read as one."""
    path = Path(path)
    if not path.is_file():
        raise DataFileError(f"{path}: no such ratings file")
    lines = path.read_text(encoding="latin-1").splitlines()
    first = lines[0] if lines else ""
    if ":token" in first or ":float" in first:  # a RecBole atomic file
        header = [field.split(":")[0] for field in first.split("\t")]
        columns = _columns(header, ("user_id", "item_id", "timestamp"), path)
        separator, start = "\t", 1
    elif path.suffix == ".csv":
        columns = _columns(first.split(","), ("userId", "movieId", "timestamp"), path)
        separator, start = ",", 1
    elif "::" in first:
        columns, separator, start = (0, 1, 3), "::", 0
    else:  # u.data
        columns, separator, start = (0, 1, 3), "\t", 0
    users, items, times = [], [], []
    user_at, item_at, time_at = columns
    for number, line in enumerate(lines[start:], start=start + 1):
        if not line.strip():
            continue
        fields = line.split(separator)
        try:
            users.append(fields[user_at])
            items.append(fields[item_at])
            times.append(float(fields[time_at]))
        except (IndexError, ValueError) as error:
            raise DataFileError(
                f"{path}, line {number}: cannot read {line[:80]!r} as a rating ({error}); "
                "expected user, item and timestamp fields"
            ) from None
    if not users:
        raise DataFileError(f"{path}: no ratings in it")
    return Ratings(users, items, times, str(path))


def _columns(header: list[str], names: tuple[str, ...], path: Path) -> tuple[int, ...]:
    missing = [name for name in names if name not in header]
    if missing:
        raise DataFileError(f"{path}: the header {header} has no {missing}")
    return tuple(header.index(name) for name in names)
