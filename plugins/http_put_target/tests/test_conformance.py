"""presigned_http_put against the kit's target conformance suite, uploading to real SigV4 presigned URLs of the
kit's S3 server (SeaweedFS on loopback; the URL signs ``If-None-Match: *``). A presigned grant is write-only, so
the read-back checks assert that ``open`` is refused with a ``TargetError``."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from urllib.parse import parse_qs, urlsplit

import pytest
from genartifact.testing.conformance import TargetConformance
from genartifact_http_put_target import PresignedHttpPutTarget, PresignedSettings


class TestPresignedConformance(TargetConformance):
    read_back = False

    @pytest.fixture(autouse=True)
    def _s3(self, s3_server):
        self.s3 = s3_server
        self.secrets = [s3_server["storage_options"]["secret"]]

    def make_target(self):
        return PresignedHttpPutTarget(PresignedSettings.parse({"allowed_hosts": [],
                                                               "insecure_http_hosts": [self.s3["authority"]]}))

    def _grant(self, key, max_bytes):
        url = self.s3["client"].generate_presigned_url(
            "put_object", Params={"Bucket": self.s3["bucket"], "Key": key, "IfNoneMatch": "*"}, ExpiresIn=600)
        self.secrets.append(parse_qs(urlsplit(url).query)["X-Amz-Signature"][0])  # must never surface
        return {"kind": "presigned_http_put", "url": url, "max_bytes": max_bytes,
                "expires_at": (datetime.now(UTC) + timedelta(minutes=9)).isoformat(),
                "required_headers": {"if-none-match": "*"}, "object_id": f"caller/{key}"}

    def target_spec(self, key):
        return self._grant(key, 1 << 20)

    def small_target_spec(self, key):
        return self._grant(key, 1024)

    def bad_specs(self):
        good = self._grant("conformance/bad.gart", 1024)
        return [({k: v for k, v in good.items() if k != "url"}, "url"),
                ({**good, "url": good["url"].replace("http://", "ftp://")}, "url"),
                ({**good, "expires_at": "2000-01-01T00:00:00+00:00"}, "expire")]
