"""Reusable conformance suites (pytest) that every backend of a layer runs, as fsspec's ``tests.abstract``, and the
SIGKILL crash harnesses (:mod:`~sfstore.testing.block_crash`, :mod:`~sfstore.testing.checkpoint_crash`, which need no
pytest).

Subclass a suite in a test module and provide its fixtures::

    from sfstore.testing.file_path import FilePathTests

    class TestMyMount(FilePathTests):
        @pytest.fixture
        def fp_root(self, tmp_path): ...

Needs pytest (the ``test`` extra); importing this package alone does not.
"""
