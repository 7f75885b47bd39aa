"""The checkpoint lifecycle above io/: when to save and restore, background saves, what may change on a resume,
lineage, averaging."""
