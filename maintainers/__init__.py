"""What maintainers run, kept out of the wheel users install.

- ``onboard``: a new vLLM release onboarded (``nox -s onboard``): its code
  read, fingerprinted, drafted into the release table, checked, reported.
- ``drafting``: a release's code read, diffed and drafted into a table entry
  (reads files only, needs no vLLM installed).
- ``interpreters``: the fingerprinted sites of a wheel on Python 3.10-3.13
  (``nox -s fingerprints``; the noxfile finds the interpreters with it).
- ``nightlies``: which split bodies vLLM main's nightly builds carry, known
  to the table or not (``nox -s nightlies``; reads wheels only).
- ``matrix``: the release matrix's records and every table generated from
  them (``nox -s matrix_table``, ``docs``).
- ``vllm_suite``: vLLM's own scheduler tests as a judge of the plugin
  (``nox -s vllm_suite``; also the pytest plugin those runs load).

They import the package from the checkout they sit in (nox runs them with
``python -m maintainers.<name>`` there); the tests import them from the
checkout too (tests/conftest.py) and the package from the installed wheel.
tests/unit/test_wheel_contents.py keeps them out of the wheel.
"""
