"""A pytest plugin for llama-server's own test suite (`tools/server/tests` of the pinned tree):
its presets download their models from a hub no machine of ours reaches, so this plugin points
the `tinyllama2` preset (the one most tests use) at a local GGUF, offline, and turns the
session's download of every preset (`ServerPreset.load_all`) off. Tests of the other presets
(embeddings, rerank, infill, MoE, vision) and those that fetch files themselves must be
deselected. Tests that assert a model's exact text fail alike on both builds: the suite is for
comparing the unpatched and the kvrelay build, not for a pass count of its own.

    cd <tree>/tools/server/tests
    KVRELAY_UPSTREAM_MODEL=/path/model.gguf LLAMA_SERVER_BIN_PATH=<server> \\
      PYTHONPATH=<this folder>:$PYTHONPATH python3 -m pytest -p upstream_local_model unit/test_basic.py
"""

import os


def pytest_sessionstart(session):
    import utils  # the suite's own module (its conftest put the folder on the path)

    model = os.environ["KVRELAY_UPSTREAM_MODEL"]
    preset = utils.ServerPreset
    original = preset.tinyllama2

    def tinyllama2():
        s = original()
        s.model_hf_repo = None
        s.model_hf_file = None
        s.model_file = model
        s.offline = True
        return s

    preset.tinyllama2 = staticmethod(tinyllama2)
    preset.load_all = staticmethod(lambda: None)
