"""The Files API's contents: one file per upload or batch output in a
folder (``<state dir>/gateway-<prefix>/files``, or ``--files-dir``, a
folder every replica mounts), its record in the gateway store.

Uploads are written to a temporary name and renamed once complete, so a
file that has a record is always whole; the size limit (OpenAI's 200 MB)
is checked while copying, before the record exists.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path
from typing import IO, Any

from jaxserve.gateway.errors import ApiError, invalid, not_found
from jaxserve.gateway.store import GatewayStore, public

#: OpenAI's limit on a batch input file
MAX_FILE_BYTES = 200 * 1024 * 1024
PURPOSES = ("batch", "batch_output")


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex[:24]


class Files:
    def __init__(self, store: GatewayStore, folder: Path, max_bytes: int = MAX_FILE_BYTES) -> None:
        self.store = store
        self.folder = folder
        self.max_bytes = max_bytes
        folder.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        if not file_id.startswith("file-") or not file_id[5:].isalnum():
            raise not_found(f"No such File object: {file_id}", "file_id")
        return self.folder / file_id

    def _record(self, file_id: str, size: int, filename: str, purpose: str, tenant: str) -> dict[str, Any]:
        return {
            "id": file_id,
            "object": "file",
            "bytes": size,
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
            "_tenant": tenant,
        }

    def write_upload(self, source: IO[bytes], file_id: str) -> int:
        """Copy an upload into place (on a worker thread); its size, or
        400 when it passes the limit (nothing is kept then)."""
        final = self.path(file_id)
        tmp = final.with_name(final.name + ".part")
        size = 0
        try:
            with open(tmp, "wb") as out:
                while chunk := source.read(1 << 20):
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise invalid(
                            f"File is too large: the limit for purpose 'batch' is {self.max_bytes} bytes "
                            f"({self.max_bytes // (1024 * 1024)} MB).",
                            "file",
                            "file_too_large",
                        )
                    out.write(chunk)
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        return size

    async def register(self, file_id: str, size: int, filename: str, purpose: str, tenant: str) -> dict[str, Any]:
        record = self._record(file_id, size, filename, purpose, tenant)
        await self.store.put_file(record)
        return record

    def adopt(self, source: Path, file_id: str) -> int:
        """Move a finished batch output into place; its size."""
        final = self.path(file_id)
        shutil.move(str(source), final)
        return final.stat().st_size

    async def get(self, file_id: str, tenant: str) -> dict[str, Any]:
        """The record, or 404: a file of another tenant does not exist for this one."""
        self.path(file_id)
        record = await self.store.get_file(file_id)
        if record is None or record.get("_tenant") != tenant:
            raise not_found(f"No such File object: {file_id}", "file_id")
        return record

    async def delete(self, file_id: str, tenant: str) -> dict[str, Any]:
        await self.get(file_id, tenant)
        await self.store.delete_file(file_id)
        self.path(file_id).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    async def listing(self, tenant: str, limit: int = 10_000) -> dict[str, Any]:
        records = await self.store.list_files(tenant, limit)
        return {"object": "list", "data": [public(r) for r in records], "has_more": False}


def check_purpose(purpose: Any) -> str:
    if purpose != "batch":
        raise ApiError(
            400,
            f"purpose must be 'batch' (the only purpose jaxserve serves), got {purpose!r}",
            "invalid_request_error",
            "purpose",
            "invalid_purpose",
        )
    return "batch"
