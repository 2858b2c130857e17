"""Data curation: ingest, filtering, dedup, decontamination, tokenization and packing."""
import os

# pyarrow 24+ allocates through its bundled mimalloc v3, whose per-thread set-up crashes processes
# that start and end many threads (apache/arrow#50908, microsoft/mimalloc#1287): Dask's worker
# threads and Prefect's task threads are such, and this project's test run died of it in a Dask
# thread reading Parquet. Arrow reads the setting once, when it is first loaded, so it is set here,
# before any module of this package imports pyarrow.
os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
