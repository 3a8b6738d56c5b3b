"""The backend registry, through real `miles.backends` entry points of distributions on sys.path."""

import subprocess
import sys
import textwrap
from pathlib import Path

import miles_core
import pytest
from miles_core import backends
from miles_core.contract import TrainBackend

TOY_MODULE = textwrap.dedent(
    """
    from miles_core.contract import DataLayout, TrainBackend

    class ToyBackend(TrainBackend):
        name = "toy"

        def init(self, args, role="actor"):
            self.role = role
            return 0

        def data_layout(self):
            return DataLayout(dp_rank=0, dp_size=1)

        def train(self, rollout_id, batch):
            return {"loss": float(rollout_id)}

        def compute_values(self, batch):
            raise ValueError("no critic")

        def update_weights(self, engines, weights=None):
            pass

        def save_model(self, rollout_id, force_sync=False):
            pass

        def sleep(self):
            pass

        def wake_up(self):
            pass

        def close(self):
            pass

    class NotABackend:
        pass
    """
)


def _install_fake_distribution(site: Path, dist: str, entry_points: dict[str, str]) -> None:
    """A minimal installed distribution: <dist>-0.0.1.dist-info with METADATA and entry_points."""
    info = site / f"{dist.replace('-', '_')}-0.0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n")
    lines = [f"{name} = {target}" for name, target in entry_points.items()]
    (info / "entry_points.txt").write_text("[miles.backends]\n" + "\n".join(lines) + "\n")


@pytest.fixture
def toy_site(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "miles_toy_backend.py").write_text(TOY_MODULE)
    _install_fake_distribution(
        site,
        "miles-toy",
        {
            "toy": "miles_toy_backend:ToyBackend",
            "toy-wrong-type": "miles_toy_backend:NotABackend",
            "toy-broken": "miles_toy_missing_dependency:Backend",
        },
    )
    monkeypatch.syspath_prepend(str(site))
    yield site
    sys.modules.pop("miles_toy_backend", None)


def test_load_through_an_entry_point(toy_site):
    assert {"toy", "toy-wrong-type", "toy-broken"} <= set(backends.available())
    cls = backends.load("toy")
    assert issubclass(cls, TrainBackend) and cls.__name__ == "ToyBackend"
    assert cls.__module__ == "miles_toy_backend"
    backend = cls()
    assert backend.init(None, role="critic") == 0
    assert backend.train(3, batch=None) == {"loss": 3.0}


def test_entry_point_that_is_not_a_backend(toy_site):
    with pytest.raises(TypeError, match="miles_toy_backend:NotABackend .* not a TrainBackend"):
        backends.load("toy-wrong-type")


def test_backend_whose_dependency_is_missing(toy_site):
    with pytest.raises(backends.BackendNotInstalledError, match="toy-broken.*failed to import"):
        backends.load("toy-broken")


def test_same_name_from_two_distributions(toy_site):
    _install_fake_distribution(toy_site, "miles-toy-fork", {"toy": "miles_toy_backend:Other"})
    with pytest.raises(RuntimeError, match="registered by several installed packages"):
        backends.load("toy")


def test_unknown_name_lists_the_known_ones(toy_site):
    with pytest.raises(ValueError) as err:
        backends.load("jax")
    message = str(err.value)
    assert "unknown training backend 'jax'" in message
    for name in ("fsdp", "megatron", "toy"):
        assert name in message


def test_known_backend_not_installed_names_the_package(tmp_path):
    """In a Python whose only distribution is miles-core, `load("fsdp")` says what to install."""
    site = tmp_path / "site"
    info = site / "miles_core-0.1.0.dist-info"
    info.mkdir(parents=True)
    info.joinpath("METADATA").write_text(
        "Metadata-Version: 2.1\nName: miles-core\nVersion: 0.1.0\n"
    )
    core_src = Path(miles_core.__file__).parent.parent
    code = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = [{str(site)!r}, {str(core_src)!r}]
        from miles_core.backends import BackendNotInstalledError, available, load
        assert available() == [], available()
        for name in ("fsdp", "megatron"):
            try:
                load(name)
            except BackendNotInstalledError as exc:
                print(exc)
        """
    )
    # -S: no site-packages, so none of this environment's distributions (or their .pth) exist.
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "training backend 'fsdp' is not installed: pip install miles-fsdp",
        "training backend 'megatron' is not installed: pip install miles-megatron",
    ]
