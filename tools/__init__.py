"""Developer tools of sfstore: benchmarks (:mod:`tools.bench`), the testbed VM, GPU checks.

They run from a checkout of the repository (``python -m tools.bench engine``) and are not part of the installed
package.
"""
