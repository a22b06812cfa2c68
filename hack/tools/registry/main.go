// Command registry is the OCI registry of the tests: go-containerregistry's
// in-process registry (the one its own tests and crane's run), served over
// HTTPS with a certificate testkit issues from its own CA, so helm, containerd
// and source-controller reach it as they reach any registry, TLS verified.
//
//	registry --address 127.0.0.1:0 --tls-cert tls.crt --tls-key tls.key [--blob-dir DIR]
//
// Once it accepts connections it prints one line, "serving https://HOST:PORT",
// on standard output: with port 0 the kernel picks a free port, and the line is
// how the caller learns it (no port is chosen first and raced for).
package main

import (
	"crypto/tls"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"

	"github.com/google/go-containerregistry/pkg/registry"
)

func main() {
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
