"""The applications: each command's job built from the library packages below it
(``train``, ``rollout``, ``proxy serve`` / ``engine serve``, the warm-start recipe).
Nothing in the library imports this package."""
