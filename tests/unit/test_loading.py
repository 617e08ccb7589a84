"""`marft_lg.loading`: the one loader of `module:attr` / `file.py:attr` specs, and the node_roles check."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

from marft_lg.loading import FILE_MODULE_PREFIX, LoadError, load_object, parse_node_roles


def _unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def _app_folder(root: Path) -> tuple[Path, str, str]:
    """A folder with an app module and a sibling helper it imports at top level and lazily."""
    helper = _unique("helper")
    mod = _unique("myapp")
    folder = root / "cfg"
    folder.mkdir()
    (folder / f"{helper}.py").write_text("GREETING = 'hi'\n")
    (folder / f"{mod}.py").write_text(
        f"import {helper}\n\n"
        "def build(llm=None):\n"
        f"    return {helper}.GREETING\n\n"
        "def build_lazy():\n"
        f"    import {helper} as h\n"
        "    return h.GREETING + '!'\n\n"
        "class Factory:\n"
        "    @staticmethod\n"
        "    def make():\n"
        "        return 'made'\n"
    )
    return folder, mod, helper


def test_package_module_attr_and_dotted_attr():
    import collections
    import json

    assert load_object("json:dumps") is json.dumps
    assert load_object("collections:OrderedDict.fromkeys") == collections.OrderedDict.fromkeys


def test_module_next_to_the_config_loads_without_pythonpath(tmp_path):
    folder, mod, _ = _app_folder(tmp_path)
    with pytest.raises(LoadError) as info:
        load_object(f"{mod}:build")
    assert info.value.missing == "module"
    fn = load_object(f"{mod}:build", base_dir=folder)
    assert fn() == "hi"
    assert load_object(f"{mod}:Factory.make", base_dir=folder)() == "made"
    # after the import the folder is still importable, but last: it never shadows installed modules
    assert sys.path[0] != str(folder.resolve()) and str(folder.resolve()) in sys.path
    assert load_object(f"{mod}:build_lazy", base_dir=folder)() == "hi!"


def test_file_spec_relative_to_base_dir_imports_its_siblings(tmp_path):
    folder, mod, _ = _app_folder(tmp_path)
    fn = load_object(f"{mod}.py:build", base_dir=folder)
    assert fn() == "hi"
    assert fn.__module__.startswith(FILE_MODULE_PREFIX)
    assert load_object(f"{mod}.py:build", base_dir=folder) is fn  # one module per file and process
    assert load_object(str(folder / f"{mod}.py") + ":build") is fn  # absolute path, same file


def test_relative_file_without_base_dir_is_taken_from_the_working_directory(tmp_path, monkeypatch):
    folder, mod, _ = _app_folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert load_object(f"cfg/{mod}.py:build_lazy")() == "hi!"


def test_source_names_the_config_file_and_sets_the_base_dir(tmp_path):
    folder, mod, _ = _app_folder(tmp_path)
    config = folder / "train.yaml"
    assert load_object(f"{mod}.py:build", source=config)() == "hi"
    with pytest.raises(LoadError, match=rf"^{config}: cannot load online.app '{mod}:buld': module '{mod}' has no "
                                        r"attribute 'buld'; did you mean 'build'\?") as info:
        load_object(f"{mod}:buld", source=config, what="online.app")
    assert info.value.missing == "attribute" and info.value.source == str(config)
    assert info.value.spec == f"{mod}:buld"


@pytest.mark.parametrize(("spec", "missing", "message"), [
    ("nocolon", "spec", "not an import path; write 'package.module:name' or 'path/to/file.py:name'"),
    ("pkg.mod:", "spec", "not an import path"),
    ("pkg.mod:not a name", "spec", "is not an attribute name"),
    ("path/to/pkg:attr", "spec", "neither a module name"),
    ("missing_file_xyz.py:build", "file", r"file .*missing_file_xyz.py does not exist \(relative paths are taken from"),
    ("no_such_pkg_xyz.mod:build", "module", "no module named 'no_such_pkg_xyz.mod' .*is the package installed"),
    ("json:no_such_thing", "attribute", "module 'json' has no attribute 'no_such_thing'"),
    ("json:dumps.nope", "attribute", "module 'json' attribute 'dumps' has no attribute 'nope'"),
])
def test_errors_say_what_is_missing(tmp_path, spec, missing, message):
    with pytest.raises(LoadError, match=message) as info:
        load_object(spec, base_dir=tmp_path, what="app")
    assert info.value.missing == missing
    assert f"cannot load app {spec!r}" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_a_module_that_fails_to_import_is_one_load_error(tmp_path):
    (tmp_path / "raises_app.py").write_text("raise RuntimeError('no API key set')\n")
    (tmp_path / "needs_dep.py").write_text("import not_installed_dep_xyz\n")
    (tmp_path / "broken.py").write_text("def f(:\n")
    with pytest.raises(LoadError, match="raised RuntimeError: no API key set") as info:
        load_object("raises_app.py:f", base_dir=tmp_path)
    assert info.value.missing == "import"
    with pytest.raises(LoadError, match="it imports 'not_installed_dep_xyz', which is not installed") as info:
        load_object("needs_dep.py:f", base_dir=tmp_path)
    assert info.value.missing == "import"
    mod = _unique("needs_dep_mod")
    (tmp_path / f"{mod}.py").write_text("import not_installed_dep_xyz\n")
    with pytest.raises(LoadError, match="it imports 'not_installed_dep_xyz'") as info:
        load_object(f"{mod}:f", base_dir=tmp_path)
    assert info.value.missing == "import"
    with pytest.raises(LoadError, match=r"broken.py:1: syntax error"):
        load_object("broken.py:f", base_dir=tmp_path)


def test_parse_node_roles_accepts_mappings_and_cli_text():
    assert parse_node_roles({"plan_step": "planner"}) == {"plan_step": "planner"}
    assert parse_node_roles("plan_step=planner, draft = writer") == {"plan_step": "planner", "draft": "writer"}
    assert parse_node_roles(None) is None and parse_node_roles({}) is None


@pytest.mark.parametrize(("value", "message"), [
    (["planner"], r"train.yaml: online.node_roles must map node names to agent roles .*got list"),
    ({"plan_step": 3}, r"train.yaml: online.node_roles: the role of node 'plan_step' must be a non-empty string"),
    ({1: "planner"}, r"train.yaml: online.node_roles: node name 1 must be a non-empty string"),
    ({"plan_step": "critic"}, r"node 'plan_step' maps to role 'critic', which is not one of the agents \['planner'"),
    ("plan_step", r"'plan_step' is not node=role"),
])
def test_parse_node_roles_errors_name_the_file_and_key(value, message):
    with pytest.raises(ValueError, match=message):
        parse_node_roles(value, source="train.yaml", key="online.node_roles", roles=["planner", "writer"])


def test_one_role_rule_for_configs_flags_and_the_team():
    import pytest

    from marft_lg._config import ConfigError
    from marft_lg.loading import check_model_mapping, check_roles, role_problem
    from marft_lg.serving.commands import parse_agents
    from marft_lg.serving.team import Team

    assert role_problem("planner") is None
    for bad in (" planner", "a@b", "a.b", "a/b", "", 3, "a b", "a\tb"):
        assert "invalid agent role" in role_problem(bad)
        with pytest.raises(ValueError, match="invalid agent role"):
            Team("never-loaded", [bad])  # refused before any model is read
    with pytest.raises(ValueError, match="invalid agent role 'a.b'"):
        parse_agents("a.b=embedded:x", "m")
    with pytest.raises(ConfigError, match="duplicate agent roles"):
        check_roles(["a", "a"])
    assert check_model_mapping({"a": "m1", "b": "m2"}, []) == ["a", "b"]
    with pytest.raises(ConfigError, match="invalid agent role ' a'") as err:
        check_model_mapping({" a": "m1"}, [])
    assert err.value.key == ("model", " a")
