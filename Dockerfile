# syntax=docker/dockerfile:1
#
# One image holding the three binaries — flux-plunger, flux-plunger-drain and
# flux-plunger-sweep — and nothing else. `make image` (hack/build-image.sh)
# first builds them static, for the x86_64-unknown-linux-musl target, into the
# build context, then builds this file with Docker where an engine runs and
# with buildah otherwise; nothing is pulled.
#
# FROM scratch, because the binaries need nothing from a base image: they are
# statically linked (no libc, no loader), never run a shell or another
# program, write no file, and trust no public CA (their only TLS peer is the
# apiserver, verified against the cluster's CA from the ServiceAccount's
# mounted ca.crt or the kubeconfig; the notification-controller address is
# plain http). No user database is needed either: the user is numeric.
FROM scratch
LABEL org.opencontainers.image.title="flux-plunger" \
      org.opencontainers.image.description="Recovers Flux HelmReleases stuck with 'has no deployed releases'; controller, drain sidecar and pre-delete sweeper" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY flux-plunger flux-plunger-drain flux-plunger-sweep /usr/local/bin/
# The chart runs each binary by name (`command: [flux-plunger-drain]`): the
# runtime looks a bare name up in the image's PATH, and scratch sets none.
ENV PATH=/usr/local/bin
# The same numeric user the chart's securityContext names; runAsNonRoot needs
# it numeric to verify it.
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/flux-plunger"]
