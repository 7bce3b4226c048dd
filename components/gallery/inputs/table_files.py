"""A team's table file that an upgrade reads (judged queries, a query log): CSV or Parquet, from
a local path (``file://`` accepted) or ``s3://bucket/key`` through the store's S3 client, its
cells resolved against the gallery's item ids. Every problem is a GalleryError of one line that
names the file, what is wrong and what to do."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from fastfill.components.gallery.layouts.catalog import GalleryError
from fastfill.components.gallery.layouts.item_ids import id_array, id_of, is_text, positions_of
from fastfill.components.gallery.store import s3_client, s3_endpoint


@dataclass(frozen=True)
class TableFile:
    """One kind of table file: ``what`` names it in messages ("judgments file"), ``setting`` is
    the configuration key that points at it, ``columns`` the columns it needs (read as text, so
    ids keep their digits and URIs stay as written), ``row`` what one row is."""

    what: str
    setting: str
    columns: tuple[str, ...]
    row: str

    def read(self, uri: str):
        """The file as a pyarrow table."""
        return self.parse(uri, self.read_bytes(uri))

    def read_bytes(self, uri: str) -> bytes:
        """The file's bytes (endpoint from AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, gallery.s3's
        retries and timeouts for ``s3://``)."""
        if not uri.startswith("s3://"):
            path = uri.removeprefix("file://")
            try:
                with open(path, "rb") as handle:
                    return handle.read()
            except FileNotFoundError:
                raise GalleryError(f"{self.what} {uri} does not exist; fix {self.setting} or create the file (CSV or "
                                   f"Parquet, columns {', '.join(self.columns)})") from None
            except OSError as error:
                raise GalleryError(f"{self.what} {uri} cannot be read ({error.strerror}); check the path and its "
                                   "permissions") from None
        return s3_bytes(uri, self.what, self.setting)

    def parse(self, uri: str, data: bytes):
        """``data`` as a pyarrow table: Parquet by its magic bytes, CSV otherwise; then the
        columns checked and at least one row."""
        import pyarrow as pa
        import pyarrow.csv as pacsv
        import pyarrow.parquet as pq

        if not data.strip():
            raise GalleryError(f"{self.what} {uri} is empty; write a header `{','.join(self.columns)}` and one row "
                               f"per {self.row}")
        try:
            if data[:4] == b"PAR1":
                table = pq.read_table(io.BytesIO(data))
            elif uri.lower().endswith((".parquet", ".pq")):
                raise GalleryError(f"{self.what} {uri} is not a Parquet file (no PAR1 header); write it again as "
                                   "Parquet or CSV")
            else:
                table = pacsv.read_csv(io.BytesIO(data), convert_options=pacsv.ConvertOptions(
                    column_types={name: pa.string() for name in self.columns}, strings_can_be_null=True))
        except (pa.ArrowInvalid, OSError) as error:
            raise GalleryError(f"{self.what} {uri} cannot be parsed as {'Parquet' if data[:4] == b'PAR1' else 'CSV'} "
                               f"({' '.join(str(error).split())[:200]}); write it as CSV or Parquet with columns "
                               f"{', '.join(self.columns)}") from None
        missing = [name for name in self.columns if name not in table.column_names]
        if missing:
            raise GalleryError(f"{self.what} {uri} lacks the column{'s' if len(missing) > 1 else ''} "
                               f"{', '.join(missing)} (it has: {', '.join(table.column_names) or 'none'}); name the "
                               f"columns {' and '.join(self.columns)}")
        if table.num_rows == 0:
            raise GalleryError(f"{self.what} {uri} has no rows; add one row per {self.row} "
                               f"({', '.join(self.columns)})")
        return table

    def queries_and_items(self, uri: str, table, column: str, ids, *, query_is: str, unknown: str
                          ) -> tuple[list, list, np.ndarray]:
        """The ``query`` column, the item ids of ``column`` and their positions among the gallery's
        ``ids``: a blank query, a value of ``column`` that is not an id, or an id the gallery does
        not have is refused, naming the rows (``query_is``: what a query cell must give;
        ``unknown``: what to do about unknown ids)."""
        queries, values = table.column("query").to_pylist(), table.column(column).to_pylist()
        blank = np.array([q is None or (isinstance(q, str) and not q.strip()) for q in queries])
        if blank.any():
            raise GalleryError(f"{self.what} {uri}: {int(blank.sum())} rows have no query (rows {file_rows(blank)}); "
                               f"give each row {query_is}")
        ids = id_array(ids)
        item_ids = [id_of(v, is_text(ids)) for v in values]
        not_ids = np.array([v is None for v in item_ids])
        if not_ids.any():
            bad = [values[i] for i in np.flatnonzero(not_ids)]
            raise GalleryError(f"{self.what} {uri}: {int(not_ids.sum())} {column} values are not item ids (rows "
                               f"{file_rows(not_ids)}: {first_few(bad, 3)}); `{column}` must hold gallery item ids")
        positions = positions_of(ids, item_ids)
        missing = positions < 0
        if missing.any():
            names = list(dict.fromkeys(item_ids[i] for i in np.flatnonzero(missing)))
            raise GalleryError(f"{self.what} {uri}: {len(names)} {column} ids are not in the gallery "
                               f"({first_few(names)}; {int(missing.sum())} rows); {unknown}")
        return queries, item_ids, positions


def first_few(values, count: int = 5) -> str:
    """The first ``count`` values, comma separated, with ``...`` when there are more."""
    shown = ", ".join(str(v) for v in values[:count])
    return shown + (", ..." if len(values) > count else "")


def file_rows(mask) -> str:
    """The rows where ``mask`` is true, as a file shows them (1-based after the header)."""
    return first_few([int(r) + 1 for r in np.flatnonzero(mask)])


def s3_bytes(uri: str, what: str, setting: str) -> bytes:
    """The bytes of the object ``uri`` (s3://bucket/key; endpoint from AWS_ENDPOINT_URL_S3 /
    AWS_ENDPOINT_URL, gallery.s3's retries and timeouts); a GalleryError of one line naming
    ``what`` the file is, why it cannot be read and what to do (``setting``: where it is named)."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    bucket, _, key = uri[len("s3://"):].partition("/")
    if not bucket or not key:
        raise GalleryError(f"{what} {uri}: an S3 location needs a bucket and a key, s3://BUCKET/KEY; fix "
                           f"{setting}")
    endpoint = s3_endpoint()
    try:
        return s3_client(endpoint).get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as error:
        code = error.response.get("Error", {}).get("Code", "")
        if code in ("NoSuchKey", "404"):
            why, todo = "does not exist", f"upload it or fix {setting}"
        elif code == "NoSuchBucket":
            why, todo = f"is in a bucket that does not exist at {endpoint or 'AWS'}", "check the URI and the endpoint"
        elif code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            why, todo = f"cannot be read: access denied ({code})", "check the AWS credentials"
        else:
            why, todo = f"cannot be read: S3 {code or error}", "check the endpoint and try again"
        raise GalleryError(f"{what} {uri} {why}; {todo}") from None
    except NoCredentialsError:
        raise GalleryError(f"{what} {uri} cannot be read: no AWS credentials; set AWS_ACCESS_KEY_ID and "
                           "AWS_SECRET_ACCESS_KEY or an AWS profile") from None
    except BotoCoreError as error:
        raise GalleryError(f"{what} {uri} cannot be read from the S3 endpoint {endpoint or 'AWS'} "
                           f"({type(error).__name__}); check that it is up and AWS_ENDPOINT_URL_S3 is right, "
                           "then try again") from None
