# syntax=docker/dockerfile:1
#
# One image holding the three binaries — flux-plunger, flux-plunger-drain and
# flux-plunger-sweep — linked statically against musl and run as a non-root
# user from distroless/static: no shell, no libc, no package manager.
# `make image` builds it; the chart runs each binary by name.
#
# The build stage runs on the target platform (buildx emulates others), so
# the native musl toolchain of the Alpine image builds ring's C code without
# a cross compiler.

ARG RUST_VERSION=1.89

FROM docker.io/library/rust:${RUST_VERSION}-alpine AS build
RUN apk add --no-cache musl-dev binutils
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY bins ./bins
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked \
      -p flux-plunger -p flux-plunger-drain -p flux-plunger-sweep \
 && mkdir -p /out \
 && cp target/release/flux-plunger target/release/flux-plunger-drain target/release/flux-plunger-sweep /out/
# Refuse a dynamically linked binary: distroless/static has no loader.
RUN for binary in /out/*; do \
      if readelf -l "$binary" | grep -q 'Requesting program interpreter'; then \
        echo "$binary is dynamically linked" >&2; exit 1; \
      fi; \
    done

FROM gcr.io/distroless/static-debian12:nonroot
LABEL org.opencontainers.image.title="flux-plunger" \
      org.opencontainers.image.description="Recovers Flux HelmReleases stuck with 'has no deployed releases'; controller, drain sidecar and pre-delete sweeper" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /out/ /usr/local/bin/
# The same numeric user the chart's securityContext names; runAsNonRoot needs
# it numeric to verify it.
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/flux-plunger"]
