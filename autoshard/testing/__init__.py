"""What the test suite and the benchmarks share: forked gloo ranks (``launch``), timed steps and table rows
(``bench``), and a measured peak to hold a memory prediction against (``memory_probe``)."""
