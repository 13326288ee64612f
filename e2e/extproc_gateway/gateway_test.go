package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/structpb"
)

// fakeEPP is an ExternalProcessor that behaves as a GIE EPP does in FULL_DUPLEX_STREAMED mode: it reads the
// whole request body, then answers the headers (naming the destination) and streams the body back.
type fakeEPP struct {
	extprocv3.UnimplementedExternalProcessorServer

	destHeader    string                       // set as x-gateway-destination-endpoint, where not ""
	destMeta      string                       // set in dynamic_metadata envoy.lb, where not ""
	immediate     *extprocv3.ImmediateResponse // answered instead, where set
	rewriteBody   func([]byte) []byte          // the body sent back; nil: as it came
	replyChunk    int                          // bytes per streamed_response chunk of the request body
	continueBody  bool                         // answer each request body message CONTINUE, no mutation
	rewriteOutput func([]byte) []byte          // applied to each response body chunk; nil: as it came
	headersDelay  time.Duration                // before answering the request headers

	mu             sync.Mutex
	requests       []*extprocv3.HttpHeaders // request_headers messages, one per stream
	requestMeta    []*corev3.Metadata       // their metadata_context
	protocolConfig []*extprocv3.ProtocolConfiguration
	bodyMessages   int
	bodyEOS        int
	responseMeta   []*corev3.Metadata // response_headers metadata_context
	responseStatus []string
	responseChunks [][]byte
	closedCleanly  int
	streamErrors   int // streams that ended in an error (the gateway cancelled them)
}

func (f *fakeEPP) headersResponse() *extprocv3.ProcessingResponse {
	resp := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
		RequestHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{
			ClearRouteCache: true,
			HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
				{Header: &corev3.HeaderValue{Key: "x-epp-picked", RawValue: []byte("yes")}},
			}, RemoveHeaders: []string{"x-drop-me"}},
		}}}}
	hm := resp.GetRequestHeaders().GetResponse().GetHeaderMutation()
	if f.destHeader != "" {
		hm.SetHeaders = append(hm.SetHeaders, &corev3.HeaderValueOption{
			Header: &corev3.HeaderValue{Key: destinationHeader, RawValue: []byte(f.destHeader)}})
	}
	if f.destMeta != "" {
		md, _ := structpb.NewStruct(map[string]any{lbNamespace: map[string]any{destinationHeader: f.destMeta}})
		resp.DynamicMetadata = md
	}
	return resp
}

func streamedBody(body []byte, eos bool) *extprocv3.CommonResponse {
	return &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
		Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{
			Body: body, EndOfStream: eos}}}}
}

func (f *fakeEPP) Process(srv extprocv3.ExternalProcessor_ProcessServer) error {
	var body []byte
	chunks := 0
	answerRequest := func() error {
		time.Sleep(f.headersDelay)
		if f.immediate != nil {
			return srv.Send(&extprocv3.ProcessingResponse{
				Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: f.immediate}})
		}
		if err := srv.Send(f.headersResponse()); err != nil {
			return err
		}
		if chunks == 0 {
			return nil
		}
		if f.continueBody {
			for range chunks {
				if err := srv.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
					RequestBody: &extprocv3.BodyResponse{}}}); err != nil {
					return err
				}
			}
			return nil
		}
		out := body
		if f.rewriteBody != nil {
			out = f.rewriteBody(body)
		}
		step := f.replyChunk
		if step <= 0 {
			step = 4096
		}
		for off := 0; ; off += step {
			end := min(off+step, len(out))
			if err := srv.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
				RequestBody: &extprocv3.BodyResponse{Response: streamedBody(out[off:end], end == len(out))}}}); err != nil {
				return err
			}
			if end == len(out) {
				return nil
			}
		}
	}
	for {
		req, err := srv.Recv()
		if err == io.EOF {
			f.mu.Lock()
			f.closedCleanly++
			f.mu.Unlock()
			return nil
		}
		if err != nil {
			f.mu.Lock()
			f.streamErrors++
			f.mu.Unlock()
			return err
		}
		switch m := req.GetRequest().(type) {
		case *extprocv3.ProcessingRequest_RequestHeaders:
			f.mu.Lock()
			f.requests = append(f.requests, m.RequestHeaders)
			f.requestMeta = append(f.requestMeta, req.GetMetadataContext())
			f.protocolConfig = append(f.protocolConfig, req.GetProtocolConfig())
			f.mu.Unlock()
			if m.RequestHeaders.GetEndOfStream() {
				if err := answerRequest(); err != nil {
					return err
				}
			}
		case *extprocv3.ProcessingRequest_RequestBody:
			body = append(body, m.RequestBody.GetBody()...)
			chunks++
			f.mu.Lock()
			f.bodyMessages++
			if m.RequestBody.GetEndOfStream() {
				f.bodyEOS++
			}
			f.mu.Unlock()
			if m.RequestBody.GetEndOfStream() {
				if err := answerRequest(); err != nil {
					return err
				}
			}
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			f.mu.Lock()
			f.responseMeta = append(f.responseMeta, req.GetMetadataContext())
			for _, h := range m.ResponseHeaders.GetHeaders().GetHeaders() {
				if h.GetKey() == ":status" {
					f.responseStatus = append(f.responseStatus, string(h.GetRawValue()))
				}
			}
			f.mu.Unlock()
			if err := srv.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
				ResponseHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{
					HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
						{Header: &corev3.HeaderValue{Key: "x-epp-response", RawValue: []byte("seen")}}}},
				}}}}); err != nil {
				return err
			}
		case *extprocv3.ProcessingRequest_ResponseBody:
			chunk := m.ResponseBody.GetBody()
			f.mu.Lock()
			f.responseChunks = append(f.responseChunks, bytes.Clone(chunk))
			f.mu.Unlock()
			if f.rewriteOutput != nil {
				chunk = f.rewriteOutput(chunk)
			}
			if err := srv.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
				ResponseBody: &extprocv3.BodyResponse{
					Response: streamedBody(chunk, m.ResponseBody.GetEndOfStream())}}}); err != nil {
				return err
			}
		}
	}
}

func startEPP(t testing.TB, f *fakeEPP) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(srv, f)
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(srv.Stop)
	return ln.Addr().String()
}

func startGateway(t testing.TB, args ...string) *httptest.Server {
	t.Helper()
	cfg, err := parseFlags(append([]string{"--listen", "127.0.0.1:0"}, args...), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	gw, err := newGateway(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(gw)
	t.Cleanup(func() { srv.Close(); gw.Close() })
	return srv
}

// backend is a fake model server that records what it was sent and answers with a small JSON body.
type backend struct {
	*httptest.Server
	mu      sync.Mutex
	bodies  [][]byte
	headers []http.Header
	paths   []string
}

func startBackend(t *testing.T) *backend {
	t.Helper()
	b := &backend{}
	b.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		b.mu.Lock()
		b.bodies = append(b.bodies, body)
		b.headers = append(b.headers, r.Header.Clone())
		b.paths = append(b.paths, r.URL.RequestURI())
		b.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Backend", b.addr())
		_, _ = fmt.Fprintf(w, `{"served_by":%q,"hello":"world"}`, b.addr())
	}))
	t.Cleanup(b.Close)
	return b
}

func (b *backend) addr() string { return b.Listener.Addr().String() }

func (b *backend) last(t *testing.T) (http.Header, []byte, string) {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.bodies) == 0 {
		t.Fatal("the backend got no request")
	}
	n := len(b.bodies) - 1
	return b.headers[n], b.bodies[n], b.paths[n]
}

// closedAddr is an ip:port nothing listens on: connecting is refused.
func closedAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return addr
}

func post(t *testing.T, url, body string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url+"/v1/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Drop-Me", "please")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, string(out)
}

func headerMap(h *extprocv3.HttpHeaders) map[string][]string {
	out := map[string][]string{}
	for _, hv := range h.GetHeaders().GetHeaders() {
		out[hv.GetKey()] = append(out[hv.GetKey()], string(hv.GetRawValue()))
	}
	return out
}

func TestDestinationByHeader(t *testing.T) {
	be := startBackend(t)
	epp := &fakeEPP{destHeader: be.addr()}
	gw := startGateway(t, "--epp", startEPP(t, epp))
	resp, body := post(t, gw.URL, `{"model":"m","prompt":"hi"}`)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	if got := resp.Header.Get(servedKey); got != be.addr() {
		t.Errorf("served header %q, want %q", got, be.addr())
	}
	if got := resp.Header.Get("X-Epp-Response"); got != "seen" {
		t.Errorf("the EPP's response header mutation was not applied: %q", got)
	}
	if !strings.Contains(body, `"hello":"world"`) {
		t.Errorf("body %q", body)
	}
	hdr, sent, path := be.last(t)
	if string(sent) != `{"model":"m","prompt":"hi"}` || path != "/v1/completions" {
		t.Errorf("backend got %q at %q", sent, path)
	}
	if hdr.Get("X-Epp-Picked") != "yes" || hdr.Get("X-Drop-Me") != "" || hdr.Get(destinationHeader) != be.addr() {
		t.Errorf("request header mutations not applied: %v", hdr)
	}
	epp.mu.Lock()
	defer epp.mu.Unlock()
	h := headerMap(epp.requests[0])
	for k, want := range map[string]string{":method": "POST", ":path": "/v1/completions", ":scheme": "http",
		":authority": strings.TrimPrefix(gw.URL, "http://"), "content-type": "application/json", "content-length": "27"} {
		if len(h[k]) != 1 || h[k][0] != want {
			t.Errorf("EPP got %s=%q, want %q", k, h[k], want)
		}
	}
	if len(h["x-request-id"]) != 1 || len(h["x-request-id"][0]) != 36 || hdr.Get("X-Request-Id") != h["x-request-id"][0] {
		t.Errorf("x-request-id: EPP %q, backend %q", h["x-request-id"], hdr.Get("X-Request-Id"))
	}
	if epp.requests[0].GetEndOfStream() || epp.bodyMessages != 1 || epp.bodyEOS != 1 {
		t.Errorf("headers eos=%v, %d body messages (%d eos)", epp.requests[0].GetEndOfStream(), epp.bodyMessages, epp.bodyEOS)
	}
	if pc := epp.protocolConfig[0]; pc.GetRequestBodyMode().String() != "FULL_DUPLEX_STREAMED" ||
		pc.GetResponseBodyMode().String() != "FULL_DUPLEX_STREAMED" {
		t.Errorf("protocol_config %v", pc)
	}
}

func TestDestinationByMetadata(t *testing.T) {
	be := startBackend(t)
	epp := &fakeEPP{destMeta: be.addr()}
	gw := startGateway(t, "--epp", startEPP(t, epp))
	resp, body := post(t, gw.URL, `{"model":"m"}`)
	if resp.StatusCode != 200 || resp.Header.Get(servedKey) != be.addr() {
		t.Fatalf("status %d, served %q: %s", resp.StatusCode, resp.Header.Get(servedKey), body)
	}
}

func TestDestinationsAgreeing(t *testing.T) {
	be := startBackend(t)
	epp := &fakeEPP{destHeader: be.addr(), destMeta: be.addr()}
	gw := startGateway(t, "--epp", startEPP(t, epp))
	if resp, body := post(t, gw.URL, `{}`); resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
}

func TestDestinationsDisagree(t *testing.T) {
	a, b := startBackend(t), startBackend(t)
	epp := &fakeEPP{destHeader: a.addr(), destMeta: b.addr()}
	gw := startGateway(t, "--epp", startEPP(t, epp))
	resp, body := post(t, gw.URL, `{}`)
	if resp.StatusCode != 500 || !strings.Contains(body, "violated") {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	if len(a.bodies)+len(b.bodies) != 0 {
		t.Error("a backend was called")
	}
}

func TestNoDestination(t *testing.T) {
	gw := startGateway(t, "--epp", startEPP(t, &fakeEPP{}))
	resp, body := post(t, gw.URL, `{}`)
	if resp.StatusCode != 500 || !strings.Contains(body, "EPP named no destination") {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
}

func TestImmediateResponse(t *testing.T) {
	be := startBackend(t)
	epp := &fakeEPP{destHeader: be.addr(), immediate: &extprocv3.ImmediateResponse{
		Status: &typev3.HttpStatus{Code: typev3.StatusCode_TooManyRequests},
		Headers: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
			{Header: &corev3.HeaderValue{Key: "retry-after", RawValue: []byte("3")}}}},
		Body: []byte(`{"error":"saturated"}`),
	}}
	gw := startGateway(t, "--epp", startEPP(t, epp))
	resp, body := post(t, gw.URL, `{"model":"m"}`)
	if resp.StatusCode != 429 || body != `{"error":"saturated"}` || resp.Header.Get("Retry-After") != "3" {
		t.Fatalf("status %d, retry-after %q: %q", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
	if len(be.bodies) != 0 {
		t.Error("the backend was called")
	}
}

func TestFallbackWhenFirstRefuses(t *testing.T) {
	be := startBackend(t)
	dead := closedAddr(t)
	epp := &fakeEPP{destHeader: dead + "," + be.addr(), destMeta: dead + ", " + be.addr()}
	gw := startGateway(t, "--epp", startEPP(t, epp))
	resp, body := post(t, gw.URL, `{}`)
	if resp.StatusCode != 200 || resp.Header.Get(servedKey) != be.addr() {
		t.Fatalf("status %d, served %q: %s", resp.StatusCode, resp.Header.Get(servedKey), body)
	}
	epp.mu.Lock()
	defer epp.mu.Unlock()
	got := epp.responseMeta[0].GetFilterMetadata()[lbNamespace].GetFields()[servedKey].GetStringValue()
	if got != be.addr() {
		t.Errorf("served metadata %q, want %q", got, be.addr())
	}
}

func TestAllEndpointsRefuse(t *testing.T) {
	epp := &fakeEPP{destHeader: closedAddr(t) + "," + closedAddr(t)}
	gw := startGateway(t, "--epp", startEPP(t, epp))
	resp, body := post(t, gw.URL, `{}`)
	if resp.StatusCode != 503 || !strings.Contains(body, "no endpoint answered") || !strings.Contains(body, "refused the connection") {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
}

func TestBodyStreamedBackInChunks(t *testing.T) {
	be := startBackend(t)
	big := strings.Repeat(`{"model":"m","prompt":"0123456789abcdef"}`, 2500) // ~100 KB
	epp := &fakeEPP{destHeader: be.addr(), replyChunk: 7000,
		rewriteBody: func(b []byte) []byte { return bytes.ReplaceAll(b, []byte(`"m"`), []byte(`"served-m"`)) }}
	gw := startGateway(t, "--epp", startEPP(t, epp), "--body-chunk", "1000")
	resp, body := post(t, gw.URL, big)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	_, sent, _ := be.last(t)
	want := strings.ReplaceAll(big, `"m"`, `"served-m"`)
	if string(sent) != want {
		t.Fatalf("backend got %d bytes, want %d (the rewritten body)", len(sent), len(want))
	}
	epp.mu.Lock()
	defer epp.mu.Unlock()
	if wantMsgs := (len(big) + 999) / 1000; epp.bodyMessages != wantMsgs || epp.bodyEOS != 1 {
		t.Errorf("EPP got %d body messages (%d eos), want %d (1 eos)", epp.bodyMessages, epp.bodyEOS, wantMsgs)
	}
}

func TestBodyContinueKeepsOriginal(t *testing.T) {
	be := startBackend(t)
	big := strings.Repeat("x", 5000)
	epp := &fakeEPP{destHeader: be.addr(), continueBody: true}
	gw := startGateway(t, "--epp", startEPP(t, epp), "--body-chunk", "1024")
	if resp, body := post(t, gw.URL, big); resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	if _, sent, _ := be.last(t); string(sent) != big {
		t.Fatalf("backend got %d bytes, want the original %d", len(sent), len(big))
	}
}

func TestNoBodyRequest(t *testing.T) {
	be := startBackend(t)
	epp := &fakeEPP{destHeader: be.addr()}
	gw := startGateway(t, "--epp", startEPP(t, epp))
	resp, err := http.Get(gw.URL + "/v1/models?x=1")
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if _, sent, path := be.last(t); len(sent) != 0 || path != "/v1/models?x=1" {
		t.Errorf("backend got %q at %q", sent, path)
	}
	epp.mu.Lock()
	defer epp.mu.Unlock()
	if !epp.requests[0].GetEndOfStream() || epp.bodyMessages != 0 {
		t.Errorf("headers eos=%v and %d body messages for a GET", epp.requests[0].GetEndOfStream(), epp.bodyMessages)
	}
	if h := headerMap(epp.requests[0]); h[":method"][0] != "GET" || h[":path"][0] != "/v1/models?x=1" ||
		h["content-length"] != nil {
		t.Errorf("headers sent to the EPP for a GET: %v", h)
	}
}

func TestSubsetHint(t *testing.T) {
	be := startBackend(t)
	epp := &fakeEPP{destHeader: be.addr()}
	gw := startGateway(t, "--epp", startEPP(t, epp), "--subset", be.addr()+",10.0.0.9:8000")
	if resp, body := post(t, gw.URL, `{}`); resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	epp.mu.Lock()
	defer epp.mu.Unlock()
	hint := epp.requestMeta[0].GetFilterMetadata()[subsetNamespace].GetFields()[subsetKey].GetListValue()
	var got []string
	for _, v := range hint.GetValues() {
		got = append(got, v.GetStringValue())
	}
	if strings.Join(got, ",") != be.addr()+",10.0.0.9:8000" {
		t.Errorf("subset hint %q", got)
	}
}

func TestServedMetadataOnResponseHeaders(t *testing.T) {
	be := startBackend(t)
	epp := &fakeEPP{destMeta: be.addr()}
	gw := startGateway(t, "--epp", startEPP(t, epp))
	if resp, body := post(t, gw.URL, `{}`); resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	epp.mu.Lock()
	defer epp.mu.Unlock()
	if len(epp.responseMeta) != 1 {
		t.Fatalf("%d response_headers messages", len(epp.responseMeta))
	}
	if got := epp.responseMeta[0].GetFilterMetadata()[lbNamespace].GetFields()[servedKey].GetStringValue(); got != be.addr() {
		t.Errorf("served metadata %q, want %q", got, be.addr())
	}
	if len(epp.responseStatus) != 1 || epp.responseStatus[0] != "200" {
		t.Errorf(":status sent to the EPP: %q", epp.responseStatus)
	}
}

func TestResponseBodyMutation(t *testing.T) {
	be := startBackend(t)
	epp := &fakeEPP{destHeader: be.addr(), rewriteOutput: bytes.ToUpper}
	gw := startGateway(t, "--epp", startEPP(t, epp))
	resp, body := post(t, gw.URL, `{}`)
	if resp.StatusCode != 200 || !strings.Contains(body, `"HELLO":"WORLD"`) {
		t.Fatalf("status %d: %q", resp.StatusCode, body)
	}
}

// sseBackend streams three events, each flushed, and holds the second until the client has the first: a
// gateway that buffers the response never delivers it.
func sseBackend(t *testing.T, proceed <-chan struct{}) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		rc := http.NewResponseController(w)
		_, _ = io.WriteString(w, "data: {\"token\":\"one\"}\n\n")
		_ = rc.Flush()
		select {
		case <-proceed:
		case <-time.After(10 * time.Second):
		}
		_, _ = io.WriteString(w, "data: {\"token\":\"two\"}\n\n")
		_ = rc.Flush()
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	}))
	t.Cleanup(srv.Close)
	return srv.Listener.Addr().String()
}

func checkSSEFlushed(t *testing.T, gwURL string, proceed chan<- struct{}) []string {
	t.Helper()
	resp, err := http.Post(gwURL+"/v1/chat/completions", "application/json", strings.NewReader(`{"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("status %d, content-type %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	lines := make(chan string)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			if sc.Text() != "" {
				lines <- sc.Text()
			}
		}
	}()
	var got []string
	select {
	case first := <-lines:
		got = append(got, first)
	case <-time.After(5 * time.Second):
		t.Fatal("the first SSE event did not reach the client while the stream was open: not flushed")
	}
	close(proceed)
	for l := range lines {
		got = append(got, l)
	}
	want := []string{`data: {"token":"one"}`, `data: {"token":"two"}`, `data: [DONE]`}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("events %q, want %q", got, want)
	}
	return got
}

func TestSSEFlushedChunkByChunk(t *testing.T) {
	proceed := make(chan struct{})
	be := sseBackend(t, proceed)
	epp := &fakeEPP{destHeader: be}
	gw := startGateway(t, "--epp", startEPP(t, epp))
	checkSSEFlushed(t, gw.URL, proceed)
	// The stream ends cleanly (CloseSend, then the EPP returns) once the client has its response.
	deadline := time.Now().Add(5 * time.Second)
	for {
		epp.mu.Lock()
		closed, chunks := epp.closedCleanly, len(epp.responseChunks)
		epp.mu.Unlock()
		if closed == 1 {
			if chunks < 3 { // at least: event one, the rest, and the empty end_of_stream message
				t.Errorf("the EPP saw %d response_body messages", chunks)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the ext-proc stream was not half-closed after the response")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestRoundRobinSSEFlushed(t *testing.T) {
	proceed := make(chan struct{})
	gw := startGateway(t, "--round-robin", "--backends", sseBackend(t, proceed))
	checkSSEFlushed(t, gw.URL, proceed)
}

func TestRoundRobin(t *testing.T) {
	a, b := startBackend(t), startBackend(t)
	dead := closedAddr(t)
	gw := startGateway(t, "--round-robin", "--backends", strings.Join([]string{a.addr(), dead, b.addr()}, ","))
	var served []string
	for range 3 {
		resp, body := post(t, gw.URL, `{"n":1}`)
		if resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, body)
		}
		served = append(served, resp.Header.Get(servedKey))
	}
	// The dead one's turn falls through to the next.
	if want := []string{a.addr(), b.addr(), b.addr()}; strings.Join(served, ",") != strings.Join(want, ",") {
		t.Errorf("served %q, want %q", served, want)
	}
	if _, sent, _ := a.last(t); string(sent) != `{"n":1}` {
		t.Errorf("backend got %q", sent)
	}
}

func TestEPPUnreachable(t *testing.T) {
	gw := startGateway(t, "--epp", closedAddr(t))
	resp, body := post(t, gw.URL, `{}`)
	var parsed struct {
		Error struct{ Message string } `json:"error"`
	}
	if resp.StatusCode != 503 || json.Unmarshal([]byte(body), &parsed) != nil || !strings.Contains(parsed.Error.Message, "EPP") {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
}

func TestEPPTimeout(t *testing.T) {
	be := startBackend(t)
	epp := &fakeEPP{destHeader: be.addr(), headersDelay: 2 * time.Second}
	gw := startGateway(t, "--epp", startEPP(t, epp), "--epp-timeout", "200ms")
	resp, body := post(t, gw.URL, `{}`)
	if resp.StatusCode != 503 || !strings.Contains(body, "--epp-timeout") {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
}

func TestMaxBody(t *testing.T) {
	be := startBackend(t)
	gw := startGateway(t, "--round-robin", "--backends", be.addr(), "--max-body", "10")
	if resp, body := post(t, gw.URL, strings.Repeat("x", 11)); resp.StatusCode != 413 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	if resp, body := post(t, gw.URL, strings.Repeat("x", 10)); resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
}

func TestFlags(t *testing.T) {
	for _, args := range [][]string{
		{},
		{"--listen", "127.0.0.1:0"},
		{"--listen", "127.0.0.1:0", "--round-robin"},
		{"--listen", "127.0.0.1:0", "--epp", "127.0.0.1:1", "--round-robin", "--backends", "127.0.0.1:2"},
		{"--listen", "127.0.0.1:0", "--epp", "127.0.0.1:1", "--subset", "nope"},
		{"--listen", "127.0.0.1:0", "--epp", "127.0.0.1:1", "--body-chunk", "0"},
	} {
		if _, err := parseFlags(args, io.Discard); err == nil {
			t.Errorf("%q: accepted", args)
		}
	}
}

func TestClientGoneCancelsUpstreamAndStream(t *testing.T) {
	upstreamCancelled := make(chan struct{})
	be := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		rc := http.NewResponseController(w)
		for {
			_, _ = io.WriteString(w, "data: tick\n\n")
			_ = rc.Flush()
			select {
			case <-r.Context().Done():
				close(upstreamCancelled)
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}))
	t.Cleanup(be.Close)
	epp := &fakeEPP{destHeader: be.Listener.Addr().String()}
	gw := startGateway(t, "--epp", startEPP(t, epp))
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, gw.URL+"/v1/completions", strings.NewReader(`{}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	if err != nil || line != "data: tick\n" {
		t.Fatalf("first line %q, %v", line, err)
	}
	cancel()
	resp.Body.Close()
	select {
	case <-upstreamCancelled:
	case <-time.After(5 * time.Second):
		t.Fatal("the upstream request went on after the client went away")
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		epp.mu.Lock()
		ended := epp.streamErrors
		epp.mu.Unlock()
		if ended == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the ext-proc stream was not cancelled after the client went away")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// BenchmarkRequest measures the gateway's own cost per request, EPP round trips included (the fake EPP and
// the backend are in-process): go test -bench . -benchtime 2000x
func BenchmarkRequest(b *testing.B) {
	for _, mode := range []string{"epp", "round-robin"} {
		b.Run(mode, func(b *testing.B) {
			be := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				_, _ = io.WriteString(w, `{"choices":[{"text":"ok"}]}`)
			}))
			defer be.Close()
			args := []string{"--round-robin", "--backends", be.Listener.Addr().String()}
			if mode == "epp" {
				args = []string{"--epp", startEPP(b, &fakeEPP{destHeader: be.Listener.Addr().String()})}
			}
			gw := startGateway(b, args...)
			body := strings.Repeat("x", 1024)
			b.SetParallelism(8) // 16 clients on 2 cores: throughput, not one client's latency
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					resp, err := http.Post(gw.URL+"/v1/completions", "application/json", strings.NewReader(body))
					if err != nil {
						b.Error(err)
						return
					}
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode != 200 {
						b.Errorf("status %d", resp.StatusCode)
					}
				}
			})
		})
	}
}

// A backend that resets the connection before any response header (a kept-alive connection to a backend that
// has just died): the next endpoint of the EPP's list answers, as with Envoy's retry_on "reset".
func TestResetBeforeHeadersGoesToTheNextEndpoint(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			buf := make([]byte, 4096)
			_, _ = c.Read(buf) // the request arrives; the backend dies before answering
			if tc, ok := c.(*net.TCPConn); ok {
				_ = tc.SetLinger(0) // RST, not FIN
			}
			c.Close()
		}
	}()
	be := startBackend(t)
	epp := &fakeEPP{destHeader: ln.Addr().String() + "," + be.addr()}
	gw := startGateway(t, "--epp", startEPP(t, epp))
	resp, body := post(t, gw.URL, `{"model":"m"}`)
	if resp.StatusCode != 200 || resp.Header.Get("x-gateway-destination-endpoint-served") != be.addr() {
		t.Fatalf("status %d, served %q: %s", resp.StatusCode, resp.Header.Get("x-gateway-destination-endpoint-served"), body)
	}
}
