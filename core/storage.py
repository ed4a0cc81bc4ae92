"""Where a run lives: a local folder (on a cluster: storage every node mounts), or a URI that pyarrow's filesystems
open (s3://, gs://, hdfs://, abfs://, file:///abs/path). The one module that tells the two apart.

A URI run keeps a local staging copy of the files the driver appends to (metrics.jsonl, rollouts, tensorboard,
config.toml) and mirrors it to the URI (`RunDir.sync`); its checkpoints are written straight to the URI by the
learner ranks (`staged`) and read back through a node-local cache (`localize`). file:// URIs go through the same
pyarrow calls as s3:// (FileSystem.from_uri, get_file_info, copy_files, open_*_stream), which is how the tests cover
the object-store path without a network.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator
from urllib.parse import unquote, urlsplit

_URI = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
# URI schemes pyarrow.fs.FileSystem.from_uri understands, and the class that must be compiled into pyarrow for each.
_SCHEMES = {"file": "LocalFileSystem", "s3": "S3FileSystem", "gs": "GcsFileSystem", "gcs": "GcsFileSystem",
            "hdfs": "HadoopFileSystem", "viewfs": "HadoopFileSystem", "abfs": "AzureFileSystem",
            "abfss": "AzureFileSystem"}


def is_uri(loc) -> bool:
    return isinstance(loc, str) and bool(_URI.match(loc))


def uri_problem(value: str, field: str = "run.output_dir") -> str | None:
    """Why a URI cannot be used, without touching the network (from_uri would look up an S3 bucket's region)."""
    if not is_uri(value):
        return None
    scheme = value.split("://", 1)[0].lower()
    fix = "use a local folder shared by all nodes, or an s3://, gs://, hdfs://, abfs:// or file:///abs/path URI"
    if scheme not in _SCHEMES:
        return f"{field}: {value!r} has the scheme {scheme!r}, which pyarrow's filesystems do not open; {fix}"
    try:
        import pyarrow.fs as pafs
    except ImportError:
        return f"{field}: {value!r} needs pyarrow (pip install pyarrow); {fix}"
    if not hasattr(pafs, _SCHEMES[scheme]):
        return (f"{field}: {value!r} needs pyarrow.fs.{_SCHEMES[scheme]}, which this pyarrow build lacks "
                f"(pip install -U pyarrow); {fix}")
    if scheme == "file" and not urlsplit(value).path.startswith("/"):
        return f"{field}: {value!r}: a file URI names an absolute path, e.g. file:///data/runs"
    return None


def absolute(loc: str) -> str | Path:
    """A user's argument as a location: URIs as given, paths expanded and absolute."""
    return loc.rstrip("/") if is_uri(loc) else Path(loc).expanduser().resolve()


def join(base, *parts: str):
    if not is_uri(base):
        return Path(base, *parts)
    u = urlsplit(base)
    return u._replace(path="/".join([u.path.rstrip("/"), *parts])).geturl()


def name(loc) -> str:
    return urlsplit(loc).path.rstrip("/").rsplit("/", 1)[-1] if is_uri(loc) else Path(loc).name


def parent(loc):
    if not is_uri(loc):
        return Path(loc).parent
    u = urlsplit(loc)
    return u._replace(path=u.path.rstrip("/").rsplit("/", 1)[0]).geturl()


@functools.lru_cache(maxsize=None)
def _root(scheme: str, netloc: str, query: str):
    """One filesystem per bucket/host (from_uri may look up an S3 bucket's region: once, not per file)."""
    from pyarrow.fs import FileSystem

    return FileSystem.from_uri(f"{scheme}://{netloc}/" + (f"?{query}" if query else ""))


def _fs(uri: str):
    """(pyarrow filesystem, path in it) of a URI."""
    u = urlsplit(uri)
    fs, root = _root(u.scheme, u.netloc, u.query)
    rest = unquote(u.path).strip("/")
    return fs, (root.rstrip("/") + "/" + rest if rest else root)


def _local_fs():
    from pyarrow.fs import LocalFileSystem

    return LocalFileSystem()


def exists(loc) -> bool:
    if not is_uri(loc):
        return Path(loc).exists()
    from pyarrow.fs import FileType

    fs, path = _fs(loc)
    return fs.get_file_info(path).type != FileType.NotFound


def is_file(loc) -> bool:
    if not is_uri(loc):
        return Path(loc).is_file()
    from pyarrow.fs import FileType

    fs, path = _fs(loc)
    return fs.get_file_info(path).type == FileType.File


def listdir(loc) -> list[str]:
    """Names in a folder (files and folders); [] when it does not exist."""
    if not is_uri(loc):
        return sorted(p.name for p in Path(loc).iterdir()) if Path(loc).is_dir() else []
    from pyarrow.fs import FileSelector

    fs, path = _fs(loc)
    return sorted(i.base_name for i in fs.get_file_info(FileSelector(path, allow_not_found=True)))


def _files(loc) -> list[tuple[str, int, int]]:
    """(relative path, size, mtime in ns) of every file under a URI folder, sorted."""
    from pyarrow.fs import FileSelector, FileType

    fs, path = _fs(loc)
    infos = fs.get_file_info(FileSelector(path, recursive=True, allow_not_found=True))
    return sorted((i.path[len(path.rstrip("/")) + 1:], i.size, i.mtime_ns or 0)
                  for i in infos if i.type == FileType.File)


def read_text(loc) -> str:
    if not is_uri(loc):
        return Path(loc).read_text()
    fs, path = _fs(loc)
    with fs.open_input_stream(path) as f:
        return f.read().decode()


def write_text(loc, text: str) -> None:
    if not is_uri(loc):
        Path(loc).write_text(text)
        return
    fs, path = _fs(loc)
    fs.create_dir(path.rpartition("/")[0], recursive=True)
    with fs.open_output_stream(path) as f:  # object stores: the object appears whole at close, or not at all
        f.write(text.encode())


def upload(local: Path, uri: str, files: list[str] | None = None) -> None:
    """Copy a local folder (or the listed files of it, relative paths) to a URI folder."""
    from pyarrow.fs import copy_files

    fs, path = _fs(uri)
    if files is None:
        files = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
    for folder in sorted({rel.rpartition("/")[0] for rel in files}):
        fs.create_dir(f"{path}/{folder}".rstrip("/"), recursive=True)  # a local filesystem needs the parents
    for rel in files:
        copy_files(str(local / rel), f"{path}/{rel}", source_filesystem=_local_fs(), destination_filesystem=fs)


def download(uri: str, local: Path, skip: tuple[str, ...] = ()) -> list[str]:
    """Copy a URI folder into `local` (top-level entries named in `skip` left out); returns the files copied."""
    from pyarrow.fs import copy_files

    fs, path = _fs(uri)
    rels = [rel for rel, _, _ in _files(uri) if rel.split("/", 1)[0] not in skip]
    for rel in rels:
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        copy_files(f"{path}/{rel}", str(local / rel), source_filesystem=fs, destination_filesystem=_local_fs())
    return rels


def delete(loc) -> None:
    """Remove a file or a folder and everything under it."""
    if not is_uri(loc):
        if Path(loc).is_dir():
            shutil.rmtree(loc)
        else:
            Path(loc).unlink(missing_ok=True)
        return
    from pyarrow.fs import FileType

    fs, path = _fs(loc)
    kind = fs.get_file_info(path).type
    if kind == FileType.Directory:
        fs.delete_dir(path)
    elif kind == FileType.File:
        fs.delete_file(path)


def move(src, dst) -> None:
    """Rename locally; on a URI copy then delete (object stores cannot rename a folder)."""
    if not is_uri(src):
        Path(src).rename(dst)
        return
    from pyarrow.fs import copy_files

    (fs, a), (_, b) = _fs(src), _fs(dst)
    fs.create_dir(b, recursive=True)  # copy_files creates the sub-folders, not this one (a local filesystem needs it)
    copy_files(a, b, source_filesystem=fs, destination_filesystem=fs)
    delete(src)


def cache_root(cache_dir: str = "") -> Path:
    """This node's qgrpo cache: `cache_dir` (a config's model.cache_dir) when given, else $QGRPO_CACHE, else
    ~/.cache/qgrpo. Builtin and converted models, downloaded URI copies and staging copies all live under it."""
    return Path(cache_dir or os.environ.get("QGRPO_CACHE") or Path.home() / ".cache" / "qgrpo").expanduser()


def localize(loc, skip: tuple[str, ...] = ()) -> str:
    """A local folder with the contents of `loc`: `loc` itself when it is a path; for a URI a copy in this node's
    cache ($QGRPO_CACHE/remote/), downloaded once. The cache key covers the URI and every file's size and mtime, so a
    re-written checkpoint is fetched again, never served stale. Two processes of one node asking at once each download
    to a temporary name; the first rename wins and the other drops its copy. `skip`: top-level entries not needed
    (rollout actors skip optimizer/)."""
    if not is_uri(loc):
        return str(loc)
    files = [f for f in _files(loc) if f[0].split("/", 1)[0] not in skip]
    if not files:
        raise FileNotFoundError(f"{loc}: nothing there to load (no files)")
    key = hashlib.sha256(repr((loc, skip, files)).encode()).hexdigest()[:16]
    target = cache_root() / "remote" / f"{name(loc)}-{key}"
    if target.is_dir():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        download(loc, tmp, skip)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; other users' actors on this node read the cache too
        try:
            tmp.rename(target)
        except OSError:  # another process of this node finished first; its copy is complete
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(target)


@contextlib.contextmanager
def staged(dest) -> Iterator[str]:
    """A folder to write `dest`'s part into: `dest` itself when it is a path; for a URI a node-local temporary folder
    whose files are uploaded to `dest` when the block succeeds (each learner rank uploads its own part)."""
    if not is_uri(dest):
        yield str(dest)
        return
    (cache_root() / "upload").mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="part-", dir=cache_root() / "upload"))
    try:
        yield str(tmp)
        upload(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------------
# A run directory: where the driver writes its logs, and where the run lives.


class StorageError(OSError):
    """The run's storage cannot hold what the run must write there; the message says where things are kept."""

# Never staged: checkpoints are written to the URI directly; a resume needs neither what earlier resumes set aside
# nor old reports.
_NOT_STAGED = ("checkpoints", "abandoned", "report")


class RunDir:
    """`root`: where the run lives (a local folder, or a URI). `local`: where the driver appends its logs: `root`
    itself, or a staging copy of a URI run that `sync` mirrors to it."""

    def __init__(self, root, local: Path):
        self.root, self.local = root, local
        self._sent: dict[str, tuple[int, int]] = {}  # staged file -> (size, mtime) as last uploaded or downloaded

    @classmethod
    def of(cls, run) -> "RunDir":
        return run if isinstance(run, RunDir) else cls(Path(run), Path(run))

    @classmethod
    def create(cls, output_dir: str, run_name: str) -> "RunDir":
        """A new run directory OUTPUT_DIR/RUN_NAME (an error if it exists)."""
        if not is_uri(output_dir):
            local = Path(output_dir).expanduser().resolve() / run_name
            local.mkdir(parents=True, exist_ok=False)
            return cls(local, local)
        root = join(output_dir.rstrip("/"), run_name)
        if exists(root):
            raise FileExistsError(f"{root} already exists")
        return cls(root, cls._staging(run_name))

    @classmethod
    def resume(cls, root) -> "RunDir":
        """An existing run; for a URI its logs are downloaded into a new staging copy (checkpoints stay remote)."""
        if not is_uri(root):
            return cls(Path(root), Path(root))
        run = cls(root, cls._staging(name(root)))
        download(root, run.local, _NOT_STAGED)
        run._sent = run._scan()
        return run

    @staticmethod
    def _staging(run_name: str) -> Path:
        # Its own folder per driver session, named like the run (W&B and TensorBoard take the folder's name).
        (cache_root() / "staging").mkdir(parents=True, exist_ok=True)
        local = Path(tempfile.mkdtemp(prefix=f"{run_name}-", dir=cache_root() / "staging")) / run_name
        local.mkdir()
        return local

    def _scan(self) -> dict[str, tuple[int, int]]:
        out = {}
        for dirpath, _, files in os.walk(self.local):
            for f in files:
                if not f.startswith("."):  # .NAME.tmp: a file being written, renamed into place when whole
                    st = os.stat(os.path.join(dirpath, f))
                    out[os.path.relpath(os.path.join(dirpath, f), self.local)] = (st.st_size, st.st_mtime_ns)
        return out

    def sync(self) -> list[str]:
        """Mirror the staging copy to the URI: upload the files that changed since the last sync, then remove from the
        URI the files this run staged that are gone locally (a resume moved them under abandoned/, uploaded first).
        Nothing else on the URI is touched. Returns the files uploaded."""
        if not is_uri(self.root):
            return []
        now = self._scan()
        changed = sorted(rel for rel, sig in now.items() if self._sent.get(rel) != sig)
        try:
            upload(self.local, self.root, changed)
            for rel in sorted(set(self._sent) - set(now)):
                delete(join(self.root, *rel.split(os.sep)))
        except OSError as e:  # pyarrow's filesystem errors are OSErrors
            raise StorageError(f"copying the run's logs to {self.root} failed ({type(e).__name__}: {e}); they are "
                               f"kept in {self.local}") from e
        self._sent = now
        return changed

    def close(self, failing: bool = False) -> None:
        """The last sync; the staging copy is removed once everything in it is on the URI. While another error is
        on its way out, a failed upload is reported and the staging copy kept instead of hiding that error."""
        if not is_uri(self.root):
            return
        try:
            self.sync()
        except StorageError as e:
            if not failing:
                raise
            print(f"qgrpo: {e}", file=sys.stderr)
            return
        shutil.rmtree(self.local.parent, ignore_errors=True)

    def __str__(self) -> str:
        return str(self.root)
