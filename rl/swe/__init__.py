"""Verifiable software-engineering environments built from real repositories (SWE-smith's and
SWE-bench's way, at this project's scale).

    sources.py   where a repository comes from: a local folder or git checkout, or a source
                 distribution from the package index at a pinned version and sha256
    python.py    the language-specific part behind `Language`: install a repository's test
                 dependencies in a virtualenv of its own, run its tests in the sandbox with that
                 virtualenv mounted read-only, read back each test's outcome
    mutate.py    bugs synthesised into the real source (swe_repair's mutation families, applied
                 as one-expression edits of the file's own text)
    build.py     per source: fetch, install, run the suite, then instances: a mutant is kept when
                 at least one test fails with it and passes without (F2P), the rest passing (P2P)

rl.envs.swe is the agentic environment over the instances; posttrain.swe_envs the stage.
"""
