package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/textproto"
	"net/url"
	"strings"
)

// hopByHop are the headers that belong to one connection, not to the request (RFC 9110 section 7.6.1).
var hopByHop = map[string]bool{
	"Connection": true, "Proxy-Connection": true, "Keep-Alive": true, "Proxy-Authenticate": true,
	"Proxy-Authorization": true, "Te": true, "Trailer": true, "Transfer-Encoding": true, "Upgrade": true,
}

// isHopByHop says whether header k of h is hop-by-hop: a fixed one, or one its Connection header names.
func isHopByHop(k string, h http.Header) bool {
	k = textproto.CanonicalMIMEHeaderKey(k)
	if hopByHop[k] {
		return true
	}
	for _, v := range h.Values("Connection") {
		for _, name := range strings.Split(v, ",") {
			if textproto.CanonicalMIMEHeaderKey(strings.TrimSpace(name)) == k {
				return true
			}
		}
	}
	return false
}

// upstreamHeaders copies the client's headers minus the hop-by-hop ones (and Content-Length, which the
// transport sets from the body it sends).
func upstreamHeaders(in http.Header) http.Header {
	out := make(http.Header, len(in))
	for k, vs := range in {
		if isHopByHop(k, in) || k == "Content-Length" {
			continue
		}
		out[k] = append([]string(nil), vs...)
	}
	return out
}

// copyHeaders copies the backend's response headers, minus the hop-by-hop ones, into the client's response.
func copyHeaders(dst, src http.Header) {
	for k, vs := range src {
		if isHopByHop(k, src) {
			continue
		}
		dst[k] = append([]string(nil), vs...)
	}
}

// isConnectError says whether err is a failure to connect: the request has certainly not reached the backend.
func isConnectError(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// forward sends the request to the endpoints in turn until one answers with response headers: a failure to
// connect, or a connection reset before any header (a kept-alive connection to a backend that has just died),
// moves on to the next, as Envoy does with retry_on "connect-failure,reset" over the EPP's fallback list. The
// body is buffered, so it can be sent again. Errors are 503 when no endpoint answered, naming each failure.
func (g *gateway) forward(ctx context.Context, r *http.Request, header http.Header, path string, body []byte,
	endpoints []string) (*http.Response, string, *httpError) {
	var refused []string
	for _, ep := range endpoints {
		req, err := http.NewRequestWithContext(ctx, r.Method, "http://"+ep+path, bytes.NewReader(body))
		if err != nil {
			return nil, "", &httpError{http.StatusBadGateway, fmt.Sprintf("cannot make a request to %s%s: %v", ep, path, err)}
		}
		req.Header = header.Clone()
		if _, ok := req.Header["User-Agent"]; !ok {
			req.Header["User-Agent"] = nil // send none rather than Go's own
		}
		req.Host = r.Host // Envoy keeps :authority unless told otherwise
		if len(body) == 0 {
			req.Body, req.GetBody, req.ContentLength = http.NoBody, nil, 0
		}
		resp, err := g.client.Do(req)
		if err == nil {
			return resp, ep, nil
		}
		if ctx.Err() != nil {
			return nil, "", &httpError{499, "the client went away"}
		}
		what := "failed before answering"
		if isConnectError(err) {
			what = "refused the connection"
		}
		refused = append(refused, fmt.Sprintf("%s %s: %v", ep, what, unwrapURLError(err)))
	}
	return nil, "", &httpError{http.StatusServiceUnavailable, "no endpoint answered: " + strings.Join(refused, "; ")}
}

// unwrapURLError drops the client's "Post \"http://...\":" prefix: the message names the endpoint already.
func unwrapURLError(err error) error {
	var u *url.Error
	if errors.As(err, &u) {
		return u.Err
	}
	return err
}
