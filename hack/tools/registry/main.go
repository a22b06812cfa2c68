// Command registry is the OCI registry of the tests: go-containerregistry's
// in-process registry (the one its own tests and crane's run), served over
// HTTPS with a certificate testkit issues from its own CA, so helm, containerd
// and source-controller reach it as they reach any registry, TLS verified.
//
//	registry --address 127.0.0.1:0 --tls-cert tls.crt --tls-key tls.key [--blob-dir DIR]
//	registry push --ca-file ca.crt ARCHIVE HOST/REPOSITORY:TAG
//
// Once it accepts connections it prints one line, "serving https://HOST:PORT",
// on standard output: with port 0 the kernel picks a free port, and the line is
// how the caller learns it (no port is chosen first and raced for).
//
// `push` writes the image of an OCI archive (what `make image` leaves in
// _out/image: an OCI image layout in a tar, from buildah or `docker save`) to
// a registry trusted through --ca-file only, and prints one line,
// "pushed HOST/REPOSITORY@sha256:...": the reference by digest a node pulls.
// The manifest is written as the archive holds it, so that digest is the
// archive's own.
package main

import (
	"archive/tar"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "push" {
		push(os.Args[2:])
		return
	}
	address := flag.String("address", "127.0.0.1:0", "address to listen on (port 0: any free port)")
	certFile := flag.String("tls-cert", "", "PEM certificate chain to serve (required)")
	keyFile := flag.String("tls-key", "", "PEM private key of --tls-cert (required)")
	blobDir := flag.String("blob-dir", "", "keep blobs in this directory instead of memory (images are large)")
	flag.Parse()
	if *certFile == "" || *keyFile == "" {
		log.Fatal("--tls-cert and --tls-key are required: the registry serves HTTPS only")
	}

	cert, err := tls.LoadX509KeyPair(*certFile, *keyFile)
	if err != nil {
		log.Fatalf("loading the TLS key pair: %v", err)
	}
	options := []registry.Option{registry.Logger(log.New(os.Stderr, "registry: ", log.LstdFlags))}
	if *blobDir != "" {
		// The disk handler writes uploads into the directory but never makes it.
		if err := os.MkdirAll(*blobDir, 0o755); err != nil {
			log.Fatalf("making the blob directory: %v", err)
		}
		options = append(options, registry.WithBlobHandler(registry.NewDiskBlobHandler(*blobDir)))
	}

	listener, err := net.Listen("tcp", *address)
	if err != nil {
		log.Fatalf("listening on %s: %v", *address, err)
	}
	server := &http.Server{
		Handler:   registry.New(options...),
		TLSConfig: &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12},
	}
	// The listener is bound: connections queue from here on, so the address
	// is usable as soon as it is printed.
	fmt.Printf("serving https://%s\n", listener.Addr())
	log.Fatal(server.ServeTLS(listener, "", ""))
}

// push ARCHIVE REFERENCE: the one image of the archive's layout, to REFERENCE.
func push(args []string) {
	flags := flag.NewFlagSet("push", flag.ExitOnError)
	caFile := flags.String("ca-file", "", "PEM CA the registry's certificate chains to (required)")
	_ = flags.Parse(args)
	if *caFile == "" || flags.NArg() != 2 {
		log.Fatal("usage: registry push --ca-file CA ARCHIVE HOST/REPOSITORY:TAG")
	}
	archive, target := flags.Arg(0), flags.Arg(1)
	ref, err := name.NewTag(target, name.StrictValidation)
	if err != nil {
		log.Fatalf("the reference %s: %v", target, err)
	}
	caPEM, err := os.ReadFile(*caFile)
	if err != nil {
		log.Fatalf("reading the CA: %v", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		log.Fatalf("%s holds no PEM certificate", *caFile)
	}
	// The CA as the only roots, no "insecure": the registry is trusted as
	// every other client here trusts it.
	transport := http.DefaultTransport.(*http.Transport).Clone()
	transport.TLSClientConfig = &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}

	digest, err := pushArchive(archive, ref, transport)
	if err != nil {
		log.Fatalf("pushing %s to %s: %v", archive, ref, err)
	}
	fmt.Printf("pushed %s@%s\n", ref.Context().Name(), digest)
}

// pushArchive writes the one image of an OCI archive to ref and returns the
// digest of its manifest.
func pushArchive(archive string, ref name.Tag, transport http.RoundTripper) (string, error) {
	dir, err := os.MkdirTemp("", "registry-push-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(dir)
	if err := untar(archive, dir); err != nil {
		return "", fmt.Errorf("unpacking: %w", err)
	}
	index, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		return "", fmt.Errorf("no OCI image layout: %w", err)
	}
	manifest, err := index.IndexManifest()
	if err != nil {
		return "", err
	}
	if len(manifest.Manifests) != 1 {
		return "", fmt.Errorf("%d images in the archive, not one", len(manifest.Manifests))
	}
	image, err := index.Image(manifest.Manifests[0].Digest)
	if err != nil {
		return "", err
	}
	digest, err := image.Digest()
	if err != nil {
		return "", err
	}
	if err := remote.Write(ref, image, remote.WithTransport(transport)); err != nil {
		return "", err
	}
	return digest.String(), nil
}

// untar unpacks the regular files and directories of a tar into dir, refusing
// any path that would leave it.
func untar(archive, dir string) error {
	file, err := os.Open(archive)
	if err != nil {
		return err
	}
	defer file.Close()
	reader := tar.NewReader(file)
	for {
		header, err := reader.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		path := filepath.Join(dir, header.Name)
		if !strings.HasPrefix(path, filepath.Clean(dir)+string(os.PathSeparator)) {
			return fmt.Errorf("%s leaves the archive's directory", header.Name)
		}
		switch header.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(path, 0o755); err != nil {
				return err
			}
		case tar.TypeReg:
			if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
				return err
			}
			out, err := os.Create(path)
			if err != nil {
				return err
			}
			_, err = io.Copy(out, reader)
			if closeErr := out.Close(); err == nil {
				err = closeErr
			}
			if err != nil {
				return err
			}
		}
	}
}
