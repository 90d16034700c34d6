"""Which config values are secrets, and the copy of a config with them replaced, for everything that leaves memory.

The live config keeps its credentials; every copy written or shown goes through :func:`redacted` after interpolation
(docs/security.md). A key is secret when a word of its name is in :data:`SECRET_WORDS`, is ``key`` or ``token``
alone, or is ``key``/``token`` after a word of :data:`SECRET_QUALIFIERS` (``pad_token`` is not); every value under
``storage_options`` and a password in a URL are redacted too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["REDACTED", "SECRET_QUALIFIERS", "SECRET_WORDS", "is_secret_key", "redact_text", "redacted"]

REDACTED = "<redacted>"

SECRET_WORDS = frozenset({
    "secret", "secrets", "password", "passwords", "passwd", "pwd", "passphrase", "credential", "credentials",
    "apikey", "accesskey", "secretkey", "privatekey", "authtoken", "accesstoken", "auth", "authorization",
    "bearer", "cookie", "cookies",
})
# Words that make a following ``key`` or ``token`` a credential.
SECRET_QUALIFIERS = frozenset({
    "access", "api", "private", "secret", "session", "account", "sas", "master", "encryption", "signing",
    "client", "service", "ssh", "gpg", "license", "storage", "hmac", "shared", "hf", "hub", "github", "gh",
    "gitlab", "wandb", "comet", "neptune", "mlflow", "bearer", "refresh", "id", "oauth", "user", "personal", "bot",
    "aws", "azure", "gcp", "gcs", "s3", "write", "read",
})
_NOUNS = frozenset({"key", "token"})  # secret as the whole name, or after a qualifier
_SECTIONS = frozenset({"storage_options"})  # every value below these keys is a secret
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
_URL_PASSWORD = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<password>[^@/\s]+)@")


def is_secret_key(name: Any) -> bool:
    """Whether a config key's name says its value is a credential (the last part of a dotted key counts)."""
    text = str(name).rpartition(".")[2]
    words = [w.lower() for w in _WORD.findall(text)]
    if not words:
        return False
    if len(words) == 1 and words[0] in _NOUNS:
        return True
    if any(w in SECRET_WORDS for w in words):
        return True
    return any(b in _NOUNS and a in SECRET_QUALIFIERS for a, b in zip(words, words[1:]))


def redact_text(text: str) -> str:
    """``text`` with the password of any ``scheme://user:password@host`` replaced."""
    return _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)


def redacted(cfg: Any) -> Any:
    """A plain copy of ``cfg``, interpolations resolved, every secret value ``"<redacted>"`` (a ``null`` stays)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(cfg, (DictConfig, ListConfig)):
        cfg = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    return _walk(cfg, hide=False)


def _walk(value: Any, hide: bool) -> Any:
    if isinstance(value, Mapping):
        return {k: _walk(v, hide or is_secret_key(k) or str(k) in _SECTIONS) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_walk(v, hide) for v in value]
    if hide and value is not None:
        return REDACTED
    return redact_text(value) if isinstance(value, str) else value
