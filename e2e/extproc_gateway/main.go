// Command extproc-gateway is the test and benchmark data plane for Sluice's Endpoint Picker (EPP): an HTTP/1.1
// gateway that, like a Gateway API Inference Extension (GIE) conformant Envoy, consults the EPP over Envoy's
// External Processing protocol (envoy.service.ext_proc.v3.ExternalProcessor/Process, request and response
// bodies in FULL_DUPLEX_STREAMED mode) for every request, and forwards the request to the endpoint the EPP picked.
// With --round-robin it consults nothing and rotates over --backends: the baseline a benchmark compares with.
//
//	extproc-gateway --listen 127.0.0.1:8080 --epp 127.0.0.1:9002 [--subset ip:port,...]
//	extproc-gateway --listen 127.0.0.1:8080 --round-robin --backends ip:port,ip:port
//
// Prints "listening on http://ADDR" on stdout once the listener is bound; logs to stderr only on errors.
// See gateway.go for the protocol as this gateway speaks it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"
)

type config struct {
	listen     string
	epp        string
	roundRobin bool
	backends   []string
	subset     []string
	eppTimeout time.Duration
	bodyChunk  int
	maxBody    int64
}

func parseFlags(args []string, stderr io.Writer) (*config, error) {
	fs := flag.NewFlagSet("extproc-gateway", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfg := &config{}
	var backends, subset string
	fs.StringVar(&cfg.listen, "listen", "", "HOST:PORT to serve HTTP/1.1 on (required; port 0 picks a free one)")
	fs.StringVar(&cfg.epp, "epp", "", "HOST:PORT of the EPP's ext-proc gRPC server (plaintext h2c)")
	fs.BoolVar(&cfg.roundRobin, "round-robin", false, "consult no EPP; rotate over --backends")
	fs.StringVar(&backends, "backends", "", "ip:port,ip:port,... for --round-robin")
	fs.StringVar(&subset, "subset", "", "ip:port,... sent to the EPP as the subset hint "+
		"(metadata_context envoy.lb.subset_hint x-gateway-destination-endpoint-subset)")
	fs.DurationVar(&cfg.eppTimeout, "epp-timeout", 30*time.Second, "how long to wait for each EPP message")
	fs.IntVar(&cfg.bodyChunk, "body-chunk", 16384, "bytes per ext-proc body message")
	fs.Int64Var(&cfg.maxBody, "max-body", 8<<20, "largest request body accepted (larger: 413)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	cfg.backends = splitList(backends)
	cfg.subset = splitList(subset)
	switch {
	case cfg.listen == "":
		return nil, errors.New("--listen HOST:PORT is required")
	case cfg.roundRobin && cfg.epp != "":
		return nil, errors.New("give either --epp or --round-robin, not both")
	case cfg.roundRobin && len(cfg.backends) == 0:
		return nil, errors.New("--round-robin needs --backends ip:port,...")
	case !cfg.roundRobin && cfg.epp == "":
		return nil, errors.New("give --epp HOST:PORT, or --round-robin --backends ip:port,...")
	case !cfg.roundRobin && len(cfg.backends) > 0:
		return nil, errors.New("--backends is for --round-robin; with --epp the EPP picks the endpoint")
	case cfg.bodyChunk <= 0:
		return nil, errors.New("--body-chunk must be positive")
	case cfg.maxBody < 0:
		return nil, errors.New("--max-body must not be negative")
	case cfg.eppTimeout <= 0:
		return nil, errors.New("--epp-timeout must be positive")
	}
	for _, ep := range append(append([]string{}, cfg.backends...), cfg.subset...) {
		if _, _, err := net.SplitHostPort(ep); err != nil {
			return nil, fmt.Errorf("%q is not ip:port: %v", ep, err)
		}
	}
	return cfg, nil
}

// splitList splits "a, b,,c" into [a b c].
func splitList(s string) []string {
	var out []string
	for _, part := range strings.Split(s, ",") {
		if part = strings.TrimSpace(part); part != "" {
			out = append(out, part)
		}
	}
	return out
}

func main() {
	cfg, err := parseFlags(os.Args[1:], os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "extproc-gateway:", err)
		os.Exit(2)
	}
	gw, err := newGateway(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "extproc-gateway:", err)
		os.Exit(1)
	}
	defer gw.Close()
	ln, err := net.Listen("tcp", cfg.listen)
	if err != nil {
		fmt.Fprintf(os.Stderr, "extproc-gateway: cannot listen on %s: %v\n", cfg.listen, err)
		os.Exit(1)
	}
	// No write timeout: responses are token streams that last as long as generation does.
	srv := &http.Server{Handler: gw, ReadHeaderTimeout: 30 * time.Second, IdleTimeout: 120 * time.Second}
	fmt.Printf("listening on http://%s\n", ln.Addr())

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	select {
	case err := <-done:
		fmt.Fprintln(os.Stderr, "extproc-gateway: serve:", err)
		os.Exit(1)
	case <-ctx.Done():
		// Let in-flight requests finish briefly; a test stopping us does not wait for streams to end.
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdown)
	}
}
