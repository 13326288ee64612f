"""TLS for the KEDA external scaler's gRPC port, with client certificates: how KEDA authenticates to it.

KEDA gives an external scaler nothing from a TriggerAuthentication but TLS material: `caCert` (to verify
this server), `tlsClientCert` and `tlsClientKey` (its identity). The operator renders a TriggerAuthentication
that reads them from a Secret (kubernetes.io/tls with ca.crt); the chart mounts the same Secret here. With
--scaler-tls-client-ca every connection must present a certificate that CA signed, or its handshake fails
before any call is served.

The files are re-read when they change (a Secret mount swaps them), at the next handshake: rotating the
certificate needs no restart.
"""

from __future__ import annotations

import logging

import grpc

from .auth import WatchedFile

log = logging.getLogger("sluice.gateway")


class ScalerTLS:
    def __init__(self, cert: str, key: str, client_ca: str | None = None, flags: str = "--scaler-tls"):
        """`flags`: the prefix of the flags that named the files (errors name them): the endpoint picker's
        port (picker.py) takes the same kind of TLS as --picker-tls-*."""
        self._files = {"cert": WatchedFile(cert, f"{flags}-cert"), "key": WatchedFile(key, f"{flags}-key")}
        if client_ca:
            self._files["ca"] = WatchedFile(client_ca, f"{flags}-client-ca")
        self._pem: dict[str, bytes] = {}
        initial = self._reload(strict=True)
        assert initial is not None
        self._initial = initial

    @property
    def requires_client_certificate(self) -> bool:
        return "ca" in self._files

    def _reload(self, strict: bool = False) -> grpc.ServerCertificateConfiguration | None:
        """A new configuration when a file changed (None: keep the current one)."""
        changed = False
        for name, watched in self._files.items():
            text = watched.changed(strict)
            if text is not None:
                if "-----BEGIN " not in text:
                    if strict:
                        raise ValueError(f"{watched.flag} {watched.path} holds no PEM block")
                    log.error("%s %s holds no PEM block; keeping the previous one", watched.flag, watched.path)
                    continue
                self._pem[name] = text.encode()
                changed = True
        if not changed:
            return None
        return grpc.ssl_server_certificate_configuration([(self._pem["key"], self._pem["cert"])],
                                                        root_certificates=self._pem.get("ca"))

    def credentials(self) -> grpc.ServerCredentials:
        # The fetcher runs before each new handshake; a broken new file must not take the port down.
        def fetch() -> grpc.ServerCertificateConfiguration | None:
            try:
                return self._reload()
            except Exception:  # noqa: BLE001 - logged; the previous certificate stays
                log.exception("re-reading the TLS files of %s failed; keeping the previous ones",
                              self._files["cert"].flag)
                return None

        return grpc.dynamic_ssl_server_credentials(self._initial, fetch,
                                                   require_client_authentication=self.requires_client_certificate)


def add_port(server: grpc.aio.Server, host: str, port: int, tls: ScalerTLS | None, what: str) -> int:
    """Bind a gRPC server's port, TLS when given (the scaler's and the picker's ports); the port bound."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
    if bound == 0:
        raise ValueError(f"cannot listen on {host}:{port} for {what}")
    return bound
