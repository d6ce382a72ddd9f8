"""What a `BackupAndRestore` backup is refused for, before anything loads.

A folder another user owns, metadata naming a file the backup did not
write, a backup made with another number of batches an epoch: each a
`BackupError` that names what differs (docs/checkpoints.md).
"""

import os
import re

#: The only weights file names a backup writes, and so the only ones its
#: metadata may name (not `..`, not an absolute path).
WEIGHTS_NAME = re.compile(r"weights-[0-9]+\.weights\.h5")


class BackupError(ValueError):
    """A backup that cannot be restored into this model."""


def check_owner(directory):
    """Refuses a backup folder another user owns: on a shared disk (a shared
    `/tmp`) they could have placed the weights this run would load, or read
    what it writes."""
    if not hasattr(os, "getuid"):
        return  # Windows: folders have no POSIX owner.
    owner = os.stat(directory).st_uid
    if owner != os.getuid():
        raise BackupError(
            f"the backup folder {directory!r} belongs to another user. "
            f"Received: a folder of uid {owner}, and this process runs as uid "
            f"{os.getuid()}; give `BackupAndRestore` a folder of your own (one "
            "that does not exist yet is made readable by you only)."
        )


def weights_name(ours, directory):
    """The weights file a backup's metadata names, accepted only as one of
    the names a backup writes."""
    name = ours.get("weights")
    if not isinstance(name, str) or not WEIGHTS_NAME.fullmatch(name):
        raise BackupError(
            f"the backup metadata in {directory!r} names the weights file "
            f"{name!r:.80}, which is not a name a backup writes. Received: "
            "metadata written by something else, or altered; delete the "
            "backup folder to start afresh."
        )
    return name


def check_batches_per_epoch(callback, ours):
    """Refuses a backup made with another number of batches an epoch: its
    position (batches trained, the epoch's shuffle) names other rows."""
    made = ours.get("batches_per_epoch")
    now = (callback.params or {}).get("steps")
    if made is None or now is None or made == now:
        return  # A backup of before, or data without a length.
    raise BackupError(
        f"the backup in {callback.backup_dir!r} was made with {made} batches "
        f"an epoch, and this run has {now}. Received: another global batch "
        "size or other data than the run that wrote the backup; resume with "
        "the same data and `batch_size` (on any number of devices), or delete "
        "the backup folder to start afresh."
    )
