"""TLS flags: consistent combinations build credentials; anything else is a one-line error
naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from foundation.tls import TlsConfigError, client_tls, server_tls
from tests.tls_certs import write_pki


def test_no_flags_is_plaintext(tmp_path: Path) -> None:
    assert server_tls(None, None, None) is None
    assert client_tls(None, None, None) is None


def test_consistent_flags_build_credentials(tmp_path: Path) -> None:
    pki = write_pki(tmp_path)
    tls = server_tls(pki.server_cert, pki.server_key, pki.ca)
    assert tls is not None and tls.client_ca == pki.ca.read_bytes()
    assert client_tls(pki.ca, pki.client_cert, pki.client_key) is not None
    assert client_tls(pki.ca, None, None) is not None


@pytest.mark.parametrize(
    ("which", "message"),
    [
        ("cert-only", "--tls-cert and --tls-key go together"),
        ("ca-only", "--tls-client-ca needs --tls-cert and --tls-key"),
        ("missing-key", "--tls-key: cannot read"),
        ("not-pem", "--tls-cert: "),
    ],
)
def test_server_flag_errors_name_the_flag(tmp_path: Path, which: str, message: str) -> None:
    pki = write_pki(tmp_path)
    bad = tmp_path / "not.pem"
    bad.write_text("hello")
    args = {
        "cert-only": (pki.server_cert, None, None),
        "ca-only": (None, None, pki.ca),
        "missing-key": (pki.server_cert, tmp_path / "nope.key", None),
        "not-pem": (bad, pki.server_key, None),
    }[which]
    with pytest.raises(TlsConfigError, match=message):
        server_tls(*args)


def test_client_flag_errors_name_the_flag(tmp_path: Path) -> None:
    pki = write_pki(tmp_path)
    with pytest.raises(TlsConfigError, match="--router-tls-cert and --router-tls-key"):
        client_tls(pki.ca, pki.client_cert, None, "--router-tls")
    with pytest.raises(TlsConfigError, match="--stage-tls-ca: cannot read"):
        client_tls(tmp_path / "missing.pem", None, None, "--stage-tls")
