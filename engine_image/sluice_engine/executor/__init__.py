"""The ranks of a layout: rank 0's runner in this process, the others launched and driven."""
