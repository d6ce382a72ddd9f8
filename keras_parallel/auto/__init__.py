"""`Auto`: the distribution chosen from the memory each candidate will
take, before the run is made for it."""
