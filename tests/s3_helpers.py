"""Looking at a bucket of the test endpoint (s3_server.py) with the tests' own client, not through nanoflow."""

from __future__ import annotations


def split(url: str) -> tuple[str, str]:
    """s3://bucket/some/prefix → ("bucket", "some/prefix")."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return bucket, prefix


def keys(endpoint, url: str) -> dict[str, int]:
    """Every object under the s3:// prefix, as {path relative to it: size}."""
    bucket, prefix = split(url)
    found = {}
    for page in endpoint.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        found.update({o["Key"][len(prefix) + 1:]: o["Size"] for o in page.get("Contents", [])})
    return found


def get(endpoint, url: str, relative: str) -> bytes:
    bucket, prefix = split(url)
    return endpoint.client().get_object(Bucket=bucket, Key=f"{prefix}/{relative}")["Body"].read()


def step_folders(endpoint, url: str) -> set[str]:
    """The immediate 'sub-folders' of the prefix (S3 CommonPrefixes)."""
    bucket, prefix = split(url)
    listing = endpoint.client().list_objects_v2(Bucket=bucket, Prefix=prefix + "/", Delimiter="/")
    return {p["Prefix"][len(prefix) + 1:].rstrip("/") for p in listing.get("CommonPrefixes", [])}


def copy_run(endpoint, source: str, target: str) -> None:
    """Server-side copy of every object of a run prefix (to damage a copy, not the shared run)."""
    client = endpoint.client()
    (sb, sp), (tb, tp) = split(source), split(target)
    for relative in keys(endpoint, source):
        client.copy_object(Bucket=tb, Key=f"{tp}/{relative}", CopySource={"Bucket": sb, "Key": f"{sp}/{relative}"})
