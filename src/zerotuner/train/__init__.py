"""The rank side: loading, caching, the loop, samples, stopping."""
