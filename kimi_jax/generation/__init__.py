"""Generation: sampling and the compiled prefill / decode loop over the static cache."""
