from __future__ import annotations

import io
import tarfile

from services.deploy.apply import file_archive
from services.deploy.desired import FileSpec


def test_the_files_archive_carries_modes_owners_and_folders():
    data = file_archive(
        {
            "env/worker.env": FileSpec(b"A=1\n", 0o600),
            "keys/worker/workers/w1.key_secret": FileSpec(b"secret", 0o600, 10001),
            "keys/worker/workers/w1.key": FileSpec(b"public", 0o644, 10001),
        }
    )
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert set(members) == {
            "env",
            "env/worker.env",
            "keys",
            "keys/worker",
            "keys/worker/workers",
            "keys/worker/workers/w1.key_secret",
            "keys/worker/workers/w1.key",
        }
        assert [(members[n].mode, members[n].uid) for n in ("keys", "keys/worker")] == [
            (0o700, 0),
            (0o700, 10001),
        ]
        secret = members["keys/worker/workers/w1.key_secret"]
        assert (secret.mode, secret.uid, secret.uname) == (0o600, 10001, "")
        assert members["keys/worker/workers/w1.key"].mode == 0o644
        assert members["env/worker.env"].uid == 0
        extracted = tar.extractfile(secret)
        assert extracted is not None and extracted.read() == b"secret"
