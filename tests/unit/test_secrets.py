"""Passwords out of every text (components/platform/secrets.py): taken out of a URI on its raw
text, whatever characters they hold, given back only to the code that connects, and removed from
any text by ``redact``: raw, percent-encoded, in libpq's keyword form, several in one text."""

from urllib.parse import quote

import pytest

from fastfill.components.platform import secrets
from fastfill.components.platform.secrets import password_for, redact, take_password

# every character that ends a URI's user part early for a URI parser
AWKWARD = ["s3cr/et", "p@ss@word", "a:b:c", "hash#tag", "per%cent", "with space", "q?uery", "all/@:#% ?of them"]


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    """Each test starts with no password taken."""
    monkeypatch.setattr(secrets, "_passwords", {})
    monkeypatch.setattr(secrets, "_secrets", set())


def _forms(password: str) -> list[str]:
    return [password, quote(password, safe=""), quote(password)]


@pytest.mark.parametrize("password", AWKWARD)
def test_a_raw_password_is_taken_out_whole_and_given_back_as_written(password):
    uri = f"postgresql://team:{password}@db.example.com:5432/gallery?sslmode=require"
    clean = take_password(uri)
    assert clean == "postgresql://team@db.example.com:5432/gallery?sslmode=require"
    assert password_for(clean) == password
    assert password_for(uri) == password  # a URI that still holds it: that one


@pytest.mark.parametrize("password", AWKWARD)
def test_a_percent_encoded_password_is_given_back_decoded(password):
    uri = f"postgresql://team:{quote(password, safe='')}@/gallery?host=/run/postgresql"
    clean = take_password(uri)
    assert clean == "postgresql://team@/gallery?host=/run/postgresql"
    assert password_for(clean) == password


@pytest.mark.parametrize("password", AWKWARD)
def test_redact_removes_every_form_of_a_taken_password_anywhere(password):
    take_password(f"postgres://team:{password}@host/db")
    for form in _forms(password):
        text = f"connection failed for {form}; retry with '{form}'"
        shown = redact(text)
        assert form not in shown and password not in shown, shown
        assert "***" in shown


@pytest.mark.parametrize("password", AWKWARD)
def test_redact_finds_a_password_in_any_uri_of_a_text_without_being_told(password):
    uri = f"postgresql://team:{password}@host:5432/db"
    for text in (uri, f"cannot connect to PostgreSQL at {uri}: connection refused",
                 f"error: {uri}\nnext line", f"{{'uri': '{uri}', 'table': 'items'}}"):
        shown = redact(text)
        assert password not in shown, shown
        assert shown.startswith(text[:text.index("team:") + 5]) and "***" in shown
    assert redact(f"at {uri}: refused") == "at postgresql://team:***@host:5432/db: refused"


def test_redact_keeps_a_uri_without_a_password_as_it_is():
    for text in ("postgresql://team@host:5432/db", "postgresql://host/db?sslmode=require",
                 "cannot connect to PostgreSQL at postgresql://team@/db?host=/tmp/pg: FATAL: password "
                 "authentication failed for user \"team\"", "s3://bucket/prefix", "models:/embedder@champion",
                 "http://127.0.0.1:5000", ""):
        assert redact(text) == text
        assert take_password(text) == text
    assert secrets._passwords == {}


def test_several_uris_in_one_text_each_lose_their_password():
    text = ("from postgresql://a:one/1@h1/db to postgres://b:two@2@h2/db, "
            "then http://c:th:ree@h3:19530 and https://d@h4/x")
    shown = redact(text)
    assert shown == ("from postgresql://a:***@h1/db to postgres://b:***@h2/db, "
                     "then http://c:***@h3:19530 and https://d@h4/x")


def test_the_keyword_form_loses_its_password():
    assert redact("host=db user=team password=s3cr/et dbname=g") == "host=db user=team password=*** dbname=g"
    assert redact("host=db password = 'a \\'quoted\\' one\\\\' dbname=g") == "host=db password = *** dbname=g"
    assert redact("host=db password='it''s doubled' dbname=g") == "host=db password=*** dbname=g"
    assert redact("password='unterminated to the end") == "password=***"
    assert redact("PGPASSWORD=hunter2 fastfill upgrade") == "PGPASSWORD=*** fastfill upgrade"


def test_only_database_and_http_uris_give_up_their_password():
    assert take_password("s3://key:secret@bucket/x") == "s3://key:secret@bucket/x"
    assert take_password("milvus.db") == "milvus.db"
    assert take_password("HTTP://u:p@h:19530") == "HTTP://u@h:19530"
    assert password_for("HTTP://u@h:19530") == "p"
    assert take_password("postgresql://team:@host/db") == "postgresql://team@host/db"  # empty: none
    assert password_for("postgresql://team@host/db") is None
    assert take_password(None) is None  # type: ignore[arg-type]
    # what decodes to text is read as libpq reads it; a % that encodes nothing is the password's own
    assert password_for(take_password("postgresql://team:pass%41word@h/db")) == "passAword"
    assert password_for(take_password("postgresql://team:100%ce@h/db")) == "100%ce"


def test_a_password_taken_once_is_redacted_from_a_text_without_its_uri():
    take_password("postgresql://team:hunter2-xyz@host/db")
    assert redact('{"detail": "user team, hunter2-xyz rejected"}') == '{"detail": "user team, *** rejected"}'


def test_the_configuration_never_holds_the_password(monkeypatch):
    """gallery.pgvector.uri and gallery.milvus.uri are read without their password: every dump
    of the configuration (Prefect's parameters, MLflow's params, the manifest) is clean, and a bad
    file's error lines show none."""
    from fastfill.components.platform.config import ConfigError, parse_params

    password = "all/@:#% ?of them"
    uri = f"postgresql://team:{password}@/db?host=/tmp/pg"
    params = parse_params({"gallery": {"layout": "pgvector", "pgvector": {"uri": uri},
                                       "milvus": {"uri": f"https://svc:{quote(password, safe='')}@m:19530"}}})
    assert params.gallery.pgvector.uri == "postgresql://team@/db?host=/tmp/pg"
    assert params.gallery.milvus.uri == "https://svc@m:19530"
    assert password_for(params.gallery.pgvector.uri) == password == password_for(params.gallery.milvus.uri)
    for dumped in (params.model_dump_json(), str(params.model_dump()), repr(params)):
        assert not any(form in dumped for form in _forms(password))

    # a problem elsewhere in the file: its lines show the sections they are about, never the password
    monkeypatch.setattr(secrets, "_secrets", set())  # the URI rule alone
    for bad in ({"gallery": {"pgvector": {"uri": uri}, "upgrade": {"method": "nope"}}},
                {"gallery": {"pgvector": {"uri": uri, "ann": "bad"}}},
                {"gallery": {"pgvector": {"uri": uri}, "layout": "nope"}}):
        with pytest.raises(ConfigError) as error:
            parse_params(bad)
        assert not any(form in str(error.value) for form in _forms(password)), str(error.value)


def test_an_mlflow_uri_keeps_no_password_and_mlflow_still_gets_it():
    """mlflow.tracking_uri with a password: the configuration (every record made of it) holds
    none, MLflow's own connection gets it back, and what a record shows has none."""
    from fastfill.components.platform import registry
    from fastfill.components.platform.config import MlflowConfig

    for written, encoded in (("http://alice:pa/ss@wd#1@mlflow.internal:5000", "pa%2Fss%40wd%231"),
                             ("postgresql://bob:s3%2Fcr%20t@db.internal/mlflow", "s3%2Fcr%20t")):
        config = MlflowConfig(tracking_uri=written, registry_uri=written)
        dumped = str(config.model_dump())
        assert "pa/ss" not in dumped and "s3" not in dumped and "cr t" not in dumped
        assert encoded in registry.tracking_uri(config) and encoded in registry.registry_uri(config)
        shown = registry.shown_uri(registry.tracking_uri(config))
        assert encoded not in shown and "pa/ss" not in shown and "cr t" not in shown and "internal" in shown
