"""The checkpoint lifecycle above io/: when to save and restore, background saves, lineage, averaging."""
