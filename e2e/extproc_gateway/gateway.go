package main

// The ext-proc exchange for one HTTP request, as a GIE-conformant Envoy runs it with the EPP's filter in
// FULL_DUPLEX_STREAMED mode for both bodies:
//
//  1. request_headers (pseudo-headers :method :path :authority :scheme, then the client's headers, lower-case,
//     values in raw_value; end_of_stream when there is no body), with the subset hint in metadata_context
//     where --subset is given; then the body in request_body messages of --body-chunk bytes, the last one
//     end_of_stream. All are sent without waiting: the EPP reads the whole body (the model name is in it)
//     before it answers anything.
//  2. The EPP answers an immediate_response (passed to the client as is), or a request_headers response (its
//     header mutation names the destination in x-gateway-destination-endpoint) and request_body responses
//     whose streamed_response chunks are the body to send upstream. The destination may also, or instead, be
//     in dynamic_metadata envoy.lb; where both are given they must agree.
//  3. The request goes to the first endpoint of the destination list that accepts a connection.
//  4. response_headers (with :status, and the endpoint that served in metadata_context envoy.lb), then each
//     chunk of the upstream body as a response_body message and an empty end_of_stream one at its end; what
//     the EPP answers to each is what the client gets.

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"maps"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"
)

// Names fixed by the GIE EPP protocol.
const (
	destinationHeader = "x-gateway-destination-endpoint"
	servedKey         = "x-gateway-destination-endpoint-served"
	subsetKey         = "x-gateway-destination-endpoint-subset"
	lbNamespace       = "envoy.lb"
	subsetNamespace   = "envoy.lb.subset_hint"
)

var logger = log.New(os.Stderr, "extproc-gateway: ", log.LstdFlags|log.Lmicroseconds)

type gateway struct {
	cfg    *config
	conn   *grpc.ClientConn // nil with --round-robin
	epp    extprocv3.ExternalProcessorClient
	client *http.Client
	next   atomic.Uint64 // --round-robin rotation
}

func newGateway(cfg *config) (*gateway, error) {
	transport := &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        4096,
		MaxIdleConnsPerHost: 1024, // a benchmark drives hundreds of concurrent streams at a few backends
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true, // pass Accept-Encoding and the encoded body through untouched
	}
	g := &gateway{
		cfg: cfg,
		client: &http.Client{
			Transport:     transport,
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		},
	}
	if cfg.roundRobin {
		return g, nil
	}
	// The EPP may stream a whole replacement body back in one message: allow bodies up to --max-body.
	msgLimit := int(cfg.maxBody) + 1<<20
	conn, err := grpc.NewClient(cfg.epp,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(msgLimit), grpc.MaxCallSendMsgSize(msgLimit)))
	if err != nil {
		return nil, fmt.Errorf("--epp %s: %v", cfg.epp, err)
	}
	g.conn, g.epp = conn, extprocv3.NewExternalProcessorClient(conn)
	return g, nil
}

func (g *gateway) Close() {
	if g.conn != nil {
		_ = g.conn.Close()
	}
	g.client.CloseIdleConnections()
}

// httpError is what the client gets when the gateway, not the backend or the EPP, answers.
type httpError struct {
	status int
	msg    string
}

func (e *httpError) Error() string { return e.msg }

func writeError(w http.ResponseWriter, status int, msg string) {
	h := w.Header()
	for k := range h {
		delete(h, k)
	}
	h.Set("Content-Type", "application/json")
	body, _ := json.Marshal(map[string]any{"error": map[string]any{
		"message": msg, "type": "extproc_gateway_error", "code": status}})
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}

func (g *gateway) fail(w http.ResponseWriter, r *http.Request, status int, format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	logger.Printf("%s %s -> %d: %s", r.Method, r.URL.RequestURI(), status, msg)
	writeError(w, status, msg)
}

func (g *gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, g.cfg.maxBody))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			g.fail(w, r, http.StatusRequestEntityTooLarge, "request body exceeds --max-body (%d bytes)", g.cfg.maxBody)
		} else {
			g.fail(w, r, http.StatusBadRequest, "reading the request body: %v", err)
		}
		return
	}
	// Envoy adds x-request-id where the client sent none, and both the EPP and the backend see it.
	if r.Header.Get("X-Request-Id") == "" {
		r.Header.Set("X-Request-Id", newRequestID())
	}
	if g.cfg.roundRobin {
		g.serveRoundRobin(w, r, body)
		return
	}
	g.serveExtProc(w, r, body)
}

func newRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6], b[8] = b[6]&0x0f|0x40, b[8]&0x3f|0x80 // a version 4 UUID, as Envoy makes
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

func (g *gateway) serveRoundRobin(w http.ResponseWriter, r *http.Request, body []byte) {
	n := len(g.cfg.backends)
	start := int((g.next.Add(1) - 1) % uint64(n))
	order := make([]string, 0, n)
	for i := range n {
		order = append(order, g.cfg.backends[(start+i)%n])
	}
	resp, served, err := g.forward(r.Context(), r, upstreamHeaders(r.Header), r.URL.RequestURI(), body, order)
	if err != nil {
		if r.Context().Err() == nil {
			g.fail(w, r, err.status, "%s", err.msg)
		}
		return
	}
	defer resp.Body.Close()
	out := w.Header()
	copyHeaders(out, resp.Header)
	out.Set(servedKey, served)
	w.WriteHeader(resp.StatusCode)
	rc := http.NewResponseController(w)
	_ = rc.Flush()
	buf := make([]byte, g.cfg.bodyChunk)
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return // the client went away; returning cancels the upstream request
			}
			_ = rc.Flush()
		}
		if err == io.EOF {
			return
		}
		if err != nil {
			logger.Printf("%s %s: upstream %s broke off the response: %v", r.Method, r.URL.RequestURI(), served, err)
			panic(http.ErrAbortHandler) // the status is sent: cut the connection so the client sees it broke
		}
	}
}

// recvResult is one message (or the error that ended the stream) from the EPP.
type recvResult struct {
	msg *extprocv3.ProcessingResponse
	err error
}

// eppStream reads the EPP's side of one Process stream in a goroutine, so that each wait is bounded by
// --epp-timeout and by the request's context, and the gateway can send while the EPP is still reading.
type eppStream struct {
	extprocv3.ExternalProcessor_ProcessClient
	ctx     context.Context
	timeout time.Duration
	msgs    chan recvResult
}

func openStream(ctx context.Context, client extprocv3.ExternalProcessorClient, timeout time.Duration) (*eppStream, error) {
	stream, err := client.Process(ctx)
	if err != nil {
		return nil, err
	}
	s := &eppStream{ExternalProcessor_ProcessClient: stream, ctx: ctx, timeout: timeout, msgs: make(chan recvResult)}
	go func() {
		for {
			msg, err := stream.Recv()
			select {
			case s.msgs <- recvResult{msg, err}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	return s, nil
}

var errClientGone = errors.New("the client went away")

// next waits for the EPP's next message; abort, when it fires, ends the wait with its error.
func (s *eppStream) next(abort <-chan error) (*extprocv3.ProcessingResponse, error) {
	timer := time.NewTimer(s.timeout)
	defer timer.Stop()
	select {
	case res := <-s.msgs:
		if res.err == io.EOF {
			return nil, errors.New("the EPP closed the stream")
		}
		return res.msg, res.err
	case err := <-abort:
		return nil, err
	case <-timer.C:
		return nil, fmt.Errorf("no message from the EPP in %s (--epp-timeout)", s.timeout)
	case <-s.ctx.Done():
		return nil, errClientGone
	}
}

func (g *gateway) serveExtProc(w http.ResponseWriter, r *http.Request, body []byte) {
	// The stream's context ends when the client goes away, or when the stream is drained after the response;
	// not when this handler returns, so that the drain can run after the client has its whole response.
	ctx, cancel := context.WithCancel(context.Background())
	stopWatching := context.AfterFunc(r.Context(), cancel)
	drained := false
	defer func() {
		if !drained || !stopWatching() {
			cancel()
		}
	}()

	stream, err := openStream(ctx, g.epp, g.cfg.eppTimeout)
	if err != nil {
		g.fail(w, r, http.StatusServiceUnavailable, "cannot open an ext-proc stream to the EPP at %s: %v", g.cfg.epp, err)
		return
	}
	sendFailed, sendDone := make(chan error, 1), make(chan struct{})
	go func() {
		defer close(sendDone)
		if err := g.sendRequest(stream, r, body); err != nil {
			sendFailed <- fmt.Errorf("sending the request to the EPP: %w", err)
		}
	}()

	up, immediate, perr := g.requestPhase(stream, r, body, sendFailed)
	if perr != nil {
		if ctx.Err() == nil {
			g.fail(w, r, perr.status, "%s", perr.msg)
		}
		return
	}
	if immediate != nil {
		writeImmediate(w, immediate)
		return
	}
	// Everything of the request has gone to the EPP before it answered the last body chunk; make sure, since
	// the stream takes one sender at a time.
	select {
	case <-sendDone:
		select {
		case err := <-sendFailed:
			g.fail(w, r, http.StatusServiceUnavailable, "%v", err)
			return
		default:
		}
	case <-time.After(g.cfg.eppTimeout):
		g.fail(w, r, http.StatusServiceUnavailable, "the EPP answered but did not take the request body in %s", g.cfg.eppTimeout)
		return
	}

	resp, served, ferr := g.forward(ctx, r, up.header, up.path, up.body, up.endpoints)
	if ferr != nil {
		if ctx.Err() == nil {
			g.fail(w, r, ferr.status, "%s (endpoints from the EPP: %s)", ferr.msg, strings.Join(up.endpoints, ","))
		}
		return
	}
	defer resp.Body.Close()
	if g.responsePhase(w, r, stream, resp, served) {
		drained = true
		go func() {
			defer cancel()
			stream.drain()
		}()
	}
}

// sendRequest sends request_headers and the body, all at once: in FULL_DUPLEX_STREAMED mode the EPP answers
// the headers only after it has read the body.
func (g *gateway) sendRequest(stream *eppStream, r *http.Request, body []byte) error {
	headers := []*corev3.HeaderValue{
		{Key: ":authority", RawValue: []byte(r.Host)},
		{Key: ":path", RawValue: []byte(r.URL.RequestURI())},
		{Key: ":method", RawValue: []byte(r.Method)},
		{Key: ":scheme", RawValue: []byte("http")},
	}
	for _, k := range slices.Sorted(maps.Keys(r.Header)) { // a fixed order, as the EPP's logs are read
		lk := strings.ToLower(k)
		if lk == "content-length" || lk == "host" {
			continue
		}
		for _, v := range r.Header[k] {
			headers = append(headers, &corev3.HeaderValue{Key: lk, RawValue: []byte(v)})
		}
	}
	// Envoy passes content-length on as the client sent it; a chunked body arrives here whole, so it gets one.
	if _, sent := r.Header["Content-Length"]; sent || len(body) > 0 {
		headers = append(headers, &corev3.HeaderValue{Key: "content-length", RawValue: []byte(strconv.Itoa(len(body)))})
	}
	first := &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers:     &corev3.HeaderMap{Headers: headers},
			EndOfStream: len(body) == 0,
		}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{
			RequestBodyMode:  filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
			ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		},
	}
	if len(g.cfg.subset) > 0 {
		list := make([]any, len(g.cfg.subset))
		for i, ep := range g.cfg.subset {
			list[i] = ep
		}
		hint, err := structpb.NewStruct(map[string]any{subsetKey: list})
		if err != nil {
			return err
		}
		first.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{subsetNamespace: hint}}
	}
	if err := stream.Send(first); err != nil {
		return err
	}
	for off := 0; off < len(body); off += g.cfg.bodyChunk {
		end := min(off+g.cfg.bodyChunk, len(body))
		err := stream.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
			RequestBody: &extprocv3.HttpBody{Body: body[off:end], EndOfStream: end == len(body)}}})
		if err != nil {
			return err
		}
	}
	return nil
}

// upstream is the request as the EPP left it.
type upstream struct {
	header    http.Header
	path      string
	body      []byte
	endpoints []string
}

// requestPhase reads the EPP's answers to the request: an immediate response, or the mutated request and
// its destination.
func (g *gateway) requestPhase(stream *eppStream, r *http.Request, body []byte,
	sendFailed <-chan error) (*upstream, *extprocv3.ImmediateResponse, *httpError) {
	chunks := (len(body) + g.cfg.bodyChunk - 1) / g.cfg.bodyChunk
	var (
		mutations          []*extprocv3.HeaderMutation
		gotHeaders         bool
		bodyDone           = chunks == 0
		streamed, replaced bool
		unmutated          int // body responses with no streamed_response: each passes one chunk on as it was
		newBody            bytes.Buffer
		metaDest           string
		metaSeen           bool
	)
	const unavailable, violation = http.StatusServiceUnavailable, http.StatusInternalServerError
	const protocolViolation = "the EPP violated the ext-proc protocol: "
	for !gotHeaders || !bodyDone {
		msg, err := stream.next(sendFailed)
		if err != nil {
			return nil, nil, &httpError{unavailable, fmt.Sprintf("ext-proc stream to the EPP at %s failed before it "+
				"named a destination: %v", g.cfg.epp, err)}
		}
		if dest, ok, derr := metadataDestination(msg.GetDynamicMetadata()); derr != nil {
			return nil, nil, &httpError{violation, protocolViolation + derr.Error()}
		} else if ok {
			metaDest, metaSeen = dest, true
		}
		switch m := msg.GetResponse().(type) {
		case *extprocv3.ProcessingResponse_ImmediateResponse:
			return nil, m.ImmediateResponse, nil
		case *extprocv3.ProcessingResponse_RequestHeaders:
			if gotHeaders {
				return nil, nil, &httpError{violation, protocolViolation + "a second request_headers response"}
			}
			gotHeaders = true
			common := m.RequestHeaders.GetResponse()
			if hm := common.GetHeaderMutation(); hm != nil {
				mutations = append(mutations, hm)
			}
			// CONTINUE_AND_REPLACE on the headers may carry the whole new body; then no body responses follow.
			if bm := common.GetBodyMutation(); bm != nil && common.GetStatus() == extprocv3.CommonResponse_CONTINUE_AND_REPLACE {
				newBody.Reset()
				newBody.Write(bm.GetBody())
				replaced, bodyDone = true, true
			}
		case *extprocv3.ProcessingResponse_RequestBody:
			if bodyDone {
				return nil, nil, &httpError{violation, protocolViolation + "a request_body response after the body ended"}
			}
			common := m.RequestBody.GetResponse()
			if hm := common.GetHeaderMutation(); hm != nil {
				mutations = append(mutations, hm)
			}
			switch bm := common.GetBodyMutation().GetMutation().(type) {
			case *extprocv3.BodyMutation_StreamedResponse:
				streamed = true
				newBody.Write(bm.StreamedResponse.GetBody())
				if bm.StreamedResponse.GetEndOfStream() {
					bodyDone = true
				}
			case *extprocv3.BodyMutation_Body:
				replaced = true
				newBody.Write(bm.Body)
				unmutated++
			case *extprocv3.BodyMutation_ClearBody:
				replaced = true
				unmutated++
			default: // CONTINUE: this chunk goes on unchanged
				unmutated++
			}
			if !streamed && unmutated >= chunks {
				bodyDone = true
			}
		default:
			return nil, nil, &httpError{violation, fmt.Sprintf("%sunexpected %T before the request was answered",
				protocolViolation, msg.GetResponse())}
		}
	}

	up := &upstream{header: upstreamHeaders(r.Header), path: r.URL.RequestURI(), body: body}
	if streamed || replaced {
		up.body = newBody.Bytes()
	}
	var headerDest string
	var headerSeen bool
	for _, hm := range mutations {
		for _, opt := range hm.GetSetHeaders() {
			key := strings.ToLower(opt.GetHeader().GetKey())
			value := headerValue(opt.GetHeader())
			switch {
			case key == destinationHeader:
				headerDest, headerSeen = value, true
			case key == ":path":
				up.path = value
				continue
			case strings.HasPrefix(key, ":") || key == "host" || strings.HasPrefix(key, "x-envoy"):
				continue // Envoy ignores these, as the HeaderMutation docs say
			}
			applySet(up.header, key, value, opt)
		}
		for _, key := range hm.GetRemoveHeaders() {
			if key = strings.ToLower(key); !strings.HasPrefix(key, ":") && key != "host" {
				up.header.Del(key)
			}
		}
	}
	var dest string
	switch {
	case headerSeen && metaSeen && normalizeList(headerDest) != normalizeList(metaDest):
		return nil, nil, &httpError{violation, fmt.Sprintf("%sheader %s is %q but dynamic metadata %s.%s is %q; "+
			"where both are given they must agree", protocolViolation, destinationHeader, headerDest, lbNamespace,
			destinationHeader, metaDest)}
	case headerSeen:
		dest = headerDest
	case metaSeen:
		dest = metaDest
	default:
		return nil, nil, &httpError{violation, fmt.Sprintf("EPP named no destination (neither header %s nor dynamic "+
			"metadata %s.%s)", destinationHeader, lbNamespace, destinationHeader)}
	}
	up.endpoints = splitList(dest)
	if len(up.endpoints) == 0 {
		return nil, nil, &httpError{violation, fmt.Sprintf("EPP named no destination (%s is empty)", destinationHeader)}
	}
	for _, ep := range up.endpoints {
		if _, _, err := net.SplitHostPort(ep); err != nil {
			return nil, nil, &httpError{violation, fmt.Sprintf("%sdestination %q is not ip:port", protocolViolation, ep)}
		}
	}
	return up, nil, nil
}

// metadataDestination reads dynamic_metadata {"envoy.lb": {"x-gateway-destination-endpoint": "ip:port,..."}}.
func metadataDestination(md *structpb.Struct) (string, bool, error) {
	lb, ok := md.GetFields()[lbNamespace]
	if !ok {
		return "", false, nil
	}
	v, ok := lb.GetStructValue().GetFields()[destinationHeader]
	if !ok {
		return "", false, nil
	}
	switch k := v.GetKind().(type) {
	case *structpb.Value_StringValue:
		return k.StringValue, true, nil
	case *structpb.Value_ListValue: // tolerated: a list of "ip:port" strings
		var eps []string
		for _, item := range k.ListValue.GetValues() {
			s, ok := item.GetKind().(*structpb.Value_StringValue)
			if !ok {
				return "", false, fmt.Errorf("dynamic metadata %s.%s holds a non-string", lbNamespace, destinationHeader)
			}
			eps = append(eps, s.StringValue)
		}
		return strings.Join(eps, ","), true, nil
	default:
		return "", false, fmt.Errorf("dynamic metadata %s.%s is not a string", lbNamespace, destinationHeader)
	}
}

func normalizeList(s string) string { return strings.Join(splitList(s), ",") }

// headerValue is a HeaderValue's value: raw_value as Envoy now uses it, else the older string value.
func headerValue(h *corev3.HeaderValue) string {
	if len(h.GetRawValue()) > 0 {
		return string(h.GetRawValue())
	}
	return h.GetValue()
}

// applySet applies one set_headers entry. ext-proc's set_headers "add or replace": an entry with neither
// append nor a non-default append_action replaces, as Envoy's ext_proc filter does.
func applySet(h http.Header, key, value string, opt *corev3.HeaderValueOption) {
	if value == "" && !opt.GetKeepEmptyValue() {
		return // Envoy drops empty values unless keep_empty_value
	}
	_, exists := h[http.CanonicalHeaderKey(key)]
	switch {
	case opt.GetAppend() != nil && opt.GetAppend().GetValue():
		h.Add(key, value)
	case opt.GetAppend() != nil:
		h.Set(key, value)
	case opt.GetAppendAction() == corev3.HeaderValueOption_ADD_IF_ABSENT:
		if !exists {
			h.Set(key, value)
		}
	case opt.GetAppendAction() == corev3.HeaderValueOption_OVERWRITE_IF_EXISTS:
		if exists {
			h.Set(key, value)
		}
	default: // APPEND_IF_EXISTS_OR_ADD left at its default, OVERWRITE_IF_EXISTS_OR_ADD
		h.Set(key, value)
	}
}

func applyMutation(h http.Header, hm *extprocv3.HeaderMutation) (status int) {
	for _, opt := range hm.GetSetHeaders() {
		key := strings.ToLower(opt.GetHeader().GetKey())
		value := headerValue(opt.GetHeader())
		if key == ":status" {
			if code, err := strconv.Atoi(value); err == nil && code >= 100 && code <= 999 {
				status = code
			}
			continue
		}
		if strings.HasPrefix(key, ":") || key == "host" || strings.HasPrefix(key, "x-envoy") {
			continue
		}
		applySet(h, key, value, opt)
	}
	for _, key := range hm.GetRemoveHeaders() {
		if key = strings.ToLower(key); !strings.HasPrefix(key, ":") && key != "host" {
			h.Del(key)
		}
	}
	return status
}

func writeImmediate(w http.ResponseWriter, ir *extprocv3.ImmediateResponse) {
	status := int(ir.GetStatus().GetCode())
	if status == 0 {
		status = http.StatusOK // Envoy's default where the EPP sets none
	}
	if s := applyMutation(w.Header(), ir.GetHeaders()); s != 0 {
		status = s
	}
	w.Header().Del("Content-Length")
	w.WriteHeader(status)
	_, _ = w.Write(ir.GetBody())
}

// responsePhase sends the upstream response through the EPP to the client. It reports whether the exchange
// ended cleanly (then the stream is half-closed and only needs draining).
func (g *gateway) responsePhase(w http.ResponseWriter, r *http.Request, stream *eppStream, resp *http.Response,
	served string) bool {
	noBody := r.Method == http.MethodHead || resp.StatusCode == http.StatusNoContent ||
		resp.StatusCode == http.StatusNotModified || resp.ContentLength == 0
	headers := []*corev3.HeaderValue{{Key: ":status", RawValue: []byte(strconv.Itoa(resp.StatusCode))}}
	for _, k := range slices.Sorted(maps.Keys(resp.Header)) {
		if isHopByHop(k, resp.Header) {
			continue
		}
		for _, v := range resp.Header[k] {
			headers = append(headers, &corev3.HeaderValue{Key: strings.ToLower(k), RawValue: []byte(v)})
		}
	}
	servedMeta, _ := structpb.NewStruct(map[string]any{servedKey: served})
	err := stream.Send(&extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: headers}, EndOfStream: noBody}},
		MetadataContext: &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{lbNamespace: servedMeta}},
	})
	var msg *extprocv3.ProcessingResponse
	if err == nil {
		msg, err = stream.next(nil)
	}
	if err != nil {
		if stream.ctx.Err() == nil {
			g.fail(w, r, http.StatusServiceUnavailable, "ext-proc stream to the EPP failed at the response headers: %v", err)
		}
		return false
	}
	status := resp.StatusCode
	out := w.Header()
	copyHeaders(out, resp.Header)
	switch m := msg.GetResponse().(type) {
	case *extprocv3.ProcessingResponse_ImmediateResponse:
		writeImmediate(w, m.ImmediateResponse)
		return false
	case *extprocv3.ProcessingResponse_ResponseHeaders:
		if s := applyMutation(out, m.ResponseHeaders.GetResponse().GetHeaderMutation()); s != 0 {
			status = s
		}
	default:
		g.fail(w, r, http.StatusInternalServerError, "the EPP violated the ext-proc protocol: %T in answer to "+
			"response_headers", msg.GetResponse())
		return false
	}
	out.Set(servedKey, served)
	if !noBody {
		out.Del("Content-Length") // the EPP may change the body's length as it streams it back
	}
	w.WriteHeader(status)
	rc := http.NewResponseController(w)
	_ = rc.Flush()
	if noBody {
		return stream.CloseSend() == nil
	}

	// The upstream body goes to the EPP as it arrives, from a goroutine; the EPP's answers go to the client
	// here. Each chunk is kept, in order, for the answers that pass a chunk on unchanged (CONTINUE).
	type chunk struct {
		data []byte
		eos  bool
	}
	pending := make(chan chunk, 1024)
	upstreamErr := make(chan error, 1)
	sendDone := make(chan struct{})
	var eosSent atomic.Bool
	go func() {
		defer close(sendDone)
		buf := make([]byte, g.cfg.bodyChunk)
		for {
			n, rerr := resp.Body.Read(buf)
			if n > 0 {
				data := bytes.Clone(buf[:n])
				select {
				case pending <- chunk{data, false}:
				case <-stream.ctx.Done():
					return
				}
				if err := stream.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
					ResponseBody: &extprocv3.HttpBody{Body: data}}}); err != nil {
					upstreamErr <- fmt.Errorf("sending the response body to the EPP: %w", err)
					return
				}
			}
			if rerr == io.EOF {
				select {
				case pending <- chunk{nil, true}:
				case <-stream.ctx.Done():
					return
				}
				eosSent.Store(true)
				if err := stream.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
					ResponseBody: &extprocv3.HttpBody{EndOfStream: true}}}); err != nil {
					upstreamErr <- fmt.Errorf("sending the end of the response body to the EPP: %w", err)
				}
				return
			}
			if rerr != nil {
				upstreamErr <- fmt.Errorf("upstream %s broke off the response: %w", served, rerr)
				return
			}
		}
	}()
	abort := func(err error) bool {
		if !errors.Is(err, errClientGone) {
			logger.Printf("%s %s: %v", r.Method, r.URL.RequestURI(), err)
		}
		panic(http.ErrAbortHandler) // the status is sent: cut the connection so the client sees it broke
	}
	popChunk := func() (chunk, error) {
		select {
		case c := <-pending:
			return c, nil
		default:
			return chunk{}, errors.New("the EPP violated the ext-proc protocol: more response_body answers than " +
				"response_body messages")
		}
	}
	for {
		msg, err := stream.next(upstreamErr)
		if err != nil {
			return abort(err)
		}
		m, ok := msg.GetResponse().(*extprocv3.ProcessingResponse_ResponseBody)
		if !ok {
			return abort(fmt.Errorf("the EPP violated the ext-proc protocol: %T in answer to response_body",
				msg.GetResponse()))
		}
		var write []byte
		end := false
		switch bm := m.ResponseBody.GetResponse().GetBodyMutation().GetMutation().(type) {
		case *extprocv3.BodyMutation_StreamedResponse:
			write, end = bm.StreamedResponse.GetBody(), bm.StreamedResponse.GetEndOfStream()
		case *extprocv3.BodyMutation_Body:
			c, err := popChunk()
			if err != nil {
				return abort(err)
			}
			write, end = bm.Body, c.eos
		case *extprocv3.BodyMutation_ClearBody:
			c, err := popChunk()
			if err != nil {
				return abort(err)
			}
			end = c.eos
		default:
			c, err := popChunk()
			if err != nil {
				return abort(err)
			}
			write, end = c.data, c.eos
		}
		if len(write) > 0 {
			if _, err := w.Write(write); err != nil {
				return abort(errClientGone)
			}
			_ = rc.Flush()
		}
		if end {
			break
		}
	}
	// The EPP may end the body before the upstream has (it owns the response): then the stream is cancelled,
	// which stops the sender and the upstream request. Otherwise the sender is done or about to be, and the
	// stream can be half-closed once it is (one sender at a time).
	if !eosSent.Load() {
		return false
	}
	select {
	case <-sendDone:
	case <-time.After(g.cfg.eppTimeout):
		return false
	}
	return stream.CloseSend() == nil
}

// drain reads what the EPP still sends after the gateway half-closed the stream, until it closes its side.
func (s *eppStream) drain() {
	for {
		if _, err := s.next(nil); err != nil {
			return
		}
	}
}
